"""CoAlign's agent-object pose graph (Lu et al., ICRA 2023) in plain torch: no g2o, no extension.

What the authors do (CoAlign, ``opencood/models/sub_modules/box_align_v2.py`` with
``pose_graph_optim.py``), and how it maps here:

* every agent detects boxes in its own frame; the boxes go to the world with the (noisy) poses;
* boxes of *different* agents whose centres lie within ``cluster_radius`` (1.5 m) of a seed box
  form an object landmark, initialised at the seed's world centre and yaw (:func:`cluster_boxes`);
* a graph: agent poses (the ego, index 0, fixed) and SE(2) landmarks, one SE(2) edge per box,
  its measurement the box (x, y, yaw) in its agent's frame, its information diag(1 / sigma^2)
  with the x / y variances scaled by the anchor diagonal squared (:func:`build_sample_graph`);
* hard cases keep the input poses: 3 or fewer landmarks, or half or more clusters whose yaws
  disagree (variance over ``yaw_var_thres``); the other disagreeing clusters get no edges;
* Levenberg-Marquardt as g2o's ``OptimizationAlgorithmLevenberg`` with a dense solver
  (:func:`levenberg_marquardt`), batched over samples;
* the authors' other switches (``box_align.args``, their defaults off but the first):
  ``landmark_SE2`` false makes every landmark an (x, y) point whose edges are g2o's
  ``EdgeSE2PointXY`` (the landmark seen from the agent minus the box centre, in the agent's
  frame; here an SE(2) edge with a zero-yaw measurement and no yaw information, which is the
  same error, and a landmark yaw that nothing moves); ``adaptive_landmark`` does so only for
  clusters whose yaws disagree and doubles their boxes' information; ``normalize_uncertainty``
  takes the square root of the information; ``drop_unsure_edge`` adds no edge for a box whose
  information sums below 100 (with the uncertainty head only, as theirs).

Deliberate differences, each because the authors' behaviour is an accident of their code:
* distances are in BEV (x, y), the authors use 3-D centres; yaw variance is taken on the yaws
  wrapped around the seed's yaw (the authors' raw ``np.var`` flags a car heading at +-pi);
* g2o stops only when a step leaves chi2 exactly unchanged or fails 10 times in a row, which at
  float64 round-off can spin to the iteration cap without moving the estimate; we also stop when
  an accepted step lowers chi2 by less than ``relative_tolerance`` of it, or leaves it under
  that fraction of its start (an exact fit) (0: g2o's rules only);
* ``half_turn_symmetric`` (default): a clustered box heading opposite its seed is turned by pi
  before the yaw check and its edge (:func:`turn_opposite_headings`). The authors' detectors
  rarely flip a heading on OPV2V; a detector whose direction classifier is less sure (measured:
  our 20-epoch stage 1 on the synthetic ``small`` split flips about 4 in 10 matched pairs) would
  otherwise lose most samples to the yaw-disagreement fallback and pull the rest by pi.

Conventions: a pose or box is ``(x, y, yaw)`` in metres and radians; tensors are solved in
float64 on the CPU (tens of vertices, hundreds of sequential tiny steps: launch latency would
dominate on a GPU) and returned on the input's device and dtype.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

# The settings live in the config schema (the ``box_align.args`` section); re-exported here.
from opencood.config_schema import BoxAlignArgs  # noqa: F401

# The authors' anchor (w 1.6 m, l 3.9 m): regression targets are offsets / anchor diagonal, so a
# predicted log variance of x or y is in units of that diagonal squared.
ANCHOR_DIAGONAL_SQ = 3.9 ** 2 + 1.6 ** 2

# Per-sample outcome of :func:`align_poses`.
SOLVED = "solved"
SINGLE_AGENT = "single_agent"            # nothing to align
FEW_LANDMARKS = "few_landmarks"          # <= min_landmarks landmarks: input poses kept
YAW_DISAGREEMENT = "yaw_disagreement"    # >= half the clusters disagree in yaw: input kept


# -- SE(2) helpers ------------------------------------------------------------------------------

def wrap_angle(angle: torch.Tensor) -> torch.Tensor:
    """Angles (any shape, rad) -> the same angles in [-pi, pi)."""
    return torch.remainder(angle + math.pi, 2 * math.pi) - math.pi


def to_world(local: torch.Tensor, pose: torch.Tensor) -> torch.Tensor:
    """(..., 3) (x, y, yaw) in a frame, the frame's (..., 3) world pose -> (..., 3) in the world."""
    cos, sin = torch.cos(pose[..., 2]), torch.sin(pose[..., 2])
    x = pose[..., 0] + cos * local[..., 0] - sin * local[..., 1]
    y = pose[..., 1] + sin * local[..., 0] + cos * local[..., 1]
    return torch.stack([x, y, wrap_angle(pose[..., 2] + local[..., 2])], dim=-1)


def to_local(world: torch.Tensor, pose: torch.Tensor) -> torch.Tensor:
    """(..., 3) world (x, y, yaw), a frame's (..., 3) world pose -> (..., 3) in that frame (the
    inverse of :func:`to_world`)."""
    cos, sin = torch.cos(pose[..., 2]), torch.sin(pose[..., 2])
    dx, dy = world[..., 0] - pose[..., 0], world[..., 1] - pose[..., 1]
    return torch.stack([cos * dx + sin * dy, -sin * dx + cos * dy,
                        wrap_angle(world[..., 2] - pose[..., 2])], dim=-1)


# -- clustering and the graph of one sample -----------------------------------------------------

def cluster_boxes(centres: torch.Tensor, agent_of_box: torch.Tensor,
                  radius: float) -> List[List[int]]:
    """Greedy seed clustering, the authors' order: boxes are visited agent by agent; an unassigned
    seed with unassigned boxes of *other* agents within ``radius`` (m) forms a cluster with them
    (the authors' loop grows a cluster from the seed's neighbours only, not transitively).

    centres (M, 2) world BEV centres, agent_of_box (M,) -> clusters, each a list of box indices,
    the seed first. A box near no other agent's box is in no cluster.
    """
    other_agent = agent_of_box[:, None] != agent_of_box[None, :]
    near = (torch.cdist(centres, centres) < radius) & other_agent
    neighbours: List[List[int]] = [[] for _ in range(len(centres))]
    for box, other in near.nonzero().tolist():      # row-major: neighbours in box order
        neighbours[box].append(other)
    assigned = [False] * len(neighbours)
    clusters = []
    for seed, seed_neighbours in enumerate(neighbours):
        if assigned[seed]:
            continue
        members = [seed] + [box for box in seed_neighbours if not assigned[box]]
        if len(members) == 1:
            continue
        for box in members:
            assigned[box] = True
        clusters.append(members)
    return clusters


def cluster_yaw_variances(yaws: torch.Tensor, clusters: List[List[int]]) -> torch.Tensor:
    """(M,) world yaws, K clusters (seed first) -> (K,) population variance of each cluster's
    yaws, wrapped around its seed's yaw (so that +pi and -pi agree)."""
    if not clusters:
        return yaws.new_zeros(0)
    members = torch.tensor([box for c in clusters for box in c])
    seeds = torch.tensor([c[0] for c in clusters for _ in c])
    cluster_of = torch.tensor([k for k, c in enumerate(clusters) for _ in c])
    offsets = wrap_angle(yaws[members] - yaws[seeds])
    sizes = torch.tensor([len(c) for c in clusters], dtype=yaws.dtype)
    mean = yaws.new_zeros(len(clusters)).index_add_(0, cluster_of, offsets) / sizes
    mean_sq = yaws.new_zeros(len(clusters)).index_add_(0, cluster_of, offsets ** 2) / sizes
    return mean_sq - mean ** 2


@dataclass
class SampleGraph:
    """One sample's graph: agent poses (the ego, 0, fixed) and landmarks, edges agent -> landmark.

    ``agents`` (A, 3) and ``landmarks`` (L, 3) initial (x, y, yaw); ``edge_agent`` (E,) in [0, A),
    ``edge_landmark`` (E,) in [0, L); ``measurement`` (E, 3) the box in its agent's frame;
    ``information`` (E, 3) the diagonal of the edge's information. ``status``: SOLVED when the
    graph is to be solved, else why the input poses are kept; ``num_landmarks``: clusters found,
    ``num_dropped``: of them, those left without edges (yaws disagree).
    """
    agents: torch.Tensor
    landmarks: torch.Tensor
    edge_agent: torch.Tensor
    edge_landmark: torch.Tensor
    measurement: torch.Tensor
    information: torch.Tensor
    status: str
    num_landmarks: int = 0
    num_dropped: int = 0


def box_information(log_var: Optional[torch.Tensor], num_boxes: int) -> torch.Tensor:
    """(M, 3) predicted log variances of (x, y, yaw) regression targets, or None -> (M, 3) the
    diagonal information of each box's edge: exp(-log_var), x / y divided by the anchor
    diagonal squared (target = offset / diagonal); all ones without uncertainty."""
    if log_var is None:
        return torch.ones(num_boxes, 3, dtype=torch.float64)
    information = torch.exp(-log_var.to(torch.float64))
    return information * information.new_tensor([1 / ANCHOR_DIAGONAL_SQ, 1 / ANCHOR_DIAGONAL_SQ, 1])


def build_sample_graph(boxes: Sequence[torch.Tensor], log_vars: Optional[Sequence[torch.Tensor]],
                       poses: torch.Tensor, args: BoxAlignArgs) -> SampleGraph:
    """One sample: ``boxes[a]`` (N_a, 3) agent a's detections in its own frame, ``log_vars[a]``
    (N_a, 3) or None, ``poses`` (A, 3) noisy world poses, the ego first -> its graph."""
    poses = poses.detach().to("cpu", torch.float64)
    local = torch.cat([b.detach().to("cpu", torch.float64).reshape(-1, 3) for b in boxes])
    agent_of_box = torch.cat([torch.full((len(b),), a, dtype=torch.long)
                              for a, b in enumerate(boxes)])
    use_log_vars = log_vars is not None and args.use_uncertainty
    log_var = (torch.cat([v.detach().cpu().reshape(-1, 3) for v in log_vars])
               if use_log_vars else None)
    information = box_information(log_var, len(local))
    if use_log_vars and args.normalize_uncertainty:
        information = information.sqrt()
    world = to_world(local, poses[agent_of_box])

    clusters = cluster_boxes(world[:, :2], agent_of_box, args.cluster_radius)
    if args.half_turn_symmetric:
        local, world = turn_opposite_headings(local, world, clusters)
    disagree = (cluster_yaw_variances(world[:, 2], clusters) > args.yaw_var_thres).tolist()
    status = hard_case_status(len(poses), len(clusters), sum(disagree), args)
    point = [not args.landmark_SE2 or (args.adaptive_landmark and bad) for bad in disagree]
    if args.landmark_SE2 and args.adaptive_landmark:
        information = doubled_for(information, [c for c, bad in zip(clusters, disagree) if bad])
    kept = [(c, is_point) for c, bad, is_point in zip(clusters, disagree, point)
            if not (bad and args.drop_hard_boxes)]

    unsure = ((information.sum(dim=1) < 100) if use_log_vars and args.drop_unsure_edge
              else torch.zeros(len(information), dtype=torch.bool)).tolist()
    edges = [(box, k, is_point) for k, (c, is_point) in enumerate(kept) for box in c
             if not unsure[box]]
    edge_box = torch.tensor([box for box, _, _ in edges], dtype=torch.long)
    edge_landmark = torch.tensor([k for _, k, _ in edges], dtype=torch.long)
    measurement, edge_information = local[edge_box], information[edge_box]
    # A point landmark's edge (g2o's EdgeSE2PointXY): no measured yaw, no yaw information.
    point_edge = torch.tensor([is_point for _, _, is_point in edges], dtype=torch.bool)
    measurement[point_edge, 2] = 0.0
    edge_information[point_edge, 2] = 0.0
    return SampleGraph(agents=poses, landmarks=world[[c[0] for c, _ in kept]].reshape(-1, 3),
                       edge_agent=agent_of_box[edge_box], edge_landmark=edge_landmark,
                       measurement=measurement, information=edge_information,
                       status=status, num_landmarks=len(clusters),
                       num_dropped=len(clusters) - len(kept))


def doubled_for(information: torch.Tensor, clusters: List[List[int]]) -> torch.Tensor:
    """(M, 3) box information with the boxes of ``clusters`` doubled (the authors' adaptive
    landmarks: a yaw-disagreeing cluster's boxes count twice as an (x, y) point)."""
    members = [box for c in clusters for box in c]
    if not members:
        return information
    doubled = information.clone()
    doubled[members] *= 2
    return doubled


def turn_opposite_headings(local: torch.Tensor, world: torch.Tensor, clusters: List[List[int]]):
    """(M, 3) boxes in their agents' frames and in the world, K clusters (seed first) -> the same
    with every clustered box whose world heading is more than 90 degrees from its seed's turned
    by pi (x, y unchanged). A box's extent is symmetric under a half turn, so its heading is only
    as good as the direction classifier: a detector that confuses front and back would otherwise
    make clusters disagree in yaw (or pull the poses by pi) over boxes that agree as boxes."""
    if not clusters:
        return local, world
    members = torch.tensor([box for c in clusters for box in c[1:]], dtype=torch.long)
    seeds = torch.tensor([c[0] for c in clusters for _ in c[1:]], dtype=torch.long)
    opposite = members[wrap_angle(world[members, 2] - world[seeds, 2]).abs() > math.pi / 2]
    local, world = local.clone(), world.clone()
    local[opposite, 2] = wrap_angle(local[opposite, 2] + math.pi)
    world[opposite, 2] = wrap_angle(world[opposite, 2] + math.pi)
    return local, world


def hard_case_status(num_agents: int, num_landmarks: int, num_disagreeing: int,
                     args: BoxAlignArgs) -> str:
    """The authors' ``abandon_hard_cases``: why a sample keeps its input poses, or SOLVED."""
    if num_agents < 2:
        return SINGLE_AGENT
    if not args.abandon_hard_cases:
        return SOLVED
    if num_landmarks <= args.min_landmarks:
        return FEW_LANDMARKS
    if num_disagreeing >= 0.5 * num_landmarks:
        return YAW_DISAGREEMENT
    return SOLVED


# -- the batched graph and its least squares ----------------------------------------------------

@dataclass
class GraphBatch:
    """Graphs padded to common sizes, (B, ...) float64 on the CPU.

    ``agents`` (B, A, 3), ``landmarks`` (B, L, 3) estimates; ``agent_free`` (B, A) /
    ``landmark_free`` (B, L) bool: optimised (not the ego, not padding); ``edge_agent`` /
    ``edge_landmark`` (B, E); ``measurement`` (B, E, 3); ``information`` (B, E, 3), zero on
    padding edges (which then weigh nothing).
    """
    agents: torch.Tensor
    landmarks: torch.Tensor
    agent_free: torch.Tensor
    landmark_free: torch.Tensor
    edge_agent: torch.Tensor
    edge_landmark: torch.Tensor
    measurement: torch.Tensor
    information: torch.Tensor


def stack_graphs(graphs: Sequence[SampleGraph]) -> GraphBatch:
    """Pad ``graphs`` to the largest agent, landmark and edge counts (at least 1 of each)."""
    num_agents = max(len(g.agents) for g in graphs)
    num_landmarks = max([len(g.landmarks) for g in graphs] + [1])
    num_edges = max([len(g.edge_agent) for g in graphs] + [1])
    batch, f64 = len(graphs), torch.float64
    out = GraphBatch(
        agents=torch.zeros(batch, num_agents, 3, dtype=f64),
        landmarks=torch.zeros(batch, num_landmarks, 3, dtype=f64),
        agent_free=torch.zeros(batch, num_agents, dtype=torch.bool),
        landmark_free=torch.zeros(batch, num_landmarks, dtype=torch.bool),
        edge_agent=torch.zeros(batch, num_edges, dtype=torch.long),
        edge_landmark=torch.zeros(batch, num_edges, dtype=torch.long),
        measurement=torch.zeros(batch, num_edges, 3, dtype=f64),
        information=torch.zeros(batch, num_edges, 3, dtype=f64))
    for b, graph in enumerate(graphs):
        agents, landmarks, edges = len(graph.agents), len(graph.landmarks), len(graph.edge_agent)
        out.agents[b, :agents], out.landmarks[b, :landmarks] = graph.agents, graph.landmarks
        out.agent_free[b, 1:agents] = True
        out.landmark_free[b, :landmarks] = True
        out.edge_agent[b, :edges] = graph.edge_agent
        out.edge_landmark[b, :edges] = graph.edge_landmark
        out.measurement[b, :edges] = graph.measurement
        out.information[b, :edges] = graph.information
    return out


def _gather(vertices: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(B, V, 3) vertices, (B, E) indices -> (B, E, 3)."""
    return torch.gather(vertices, 1, index[..., None].expand(-1, -1, 3))


def edge_residuals(agents: torch.Tensor, landmarks: torch.Tensor,
                   graph: GraphBatch) -> torch.Tensor:
    """(B, A, 3), (B, L, 3) estimates -> (B, E, 3) g2o ``EdgeSE2`` errors: the measurement's
    inverse times the landmark seen from the agent, as (x, y, wrapped yaw)."""
    seen = to_local(_gather(landmarks, graph.edge_landmark), _gather(agents, graph.edge_agent))
    return to_local(seen, graph.measurement)


def edge_jacobians(agents: torch.Tensor, landmarks: torch.Tensor, graph: GraphBatch):
    """Estimates -> d residual / d agent and d residual / d landmark, (B, E, 3, 3) each, for
    additive (x, y, yaw) updates (g2o's analytic ``EdgeSE2::linearizeOplus``)."""
    agent = _gather(agents, graph.edge_agent)
    landmark = _gather(landmarks, graph.edge_landmark)
    cos_a, sin_a = torch.cos(agent[..., 2]), torch.sin(agent[..., 2])
    cos_m, sin_m = torch.cos(graph.measurement[..., 2]), torch.sin(graph.measurement[..., 2])
    dx, dy = landmark[..., 0] - agent[..., 0], landmark[..., 1] - agent[..., 1]
    zero, one = torch.zeros_like(dx), torch.ones_like(dx)

    def matrix(rows):
        return torch.stack([torch.stack(row, -1) for row in rows], -2)

    # Derivatives of the landmark seen from the agent, then rotated into the measurement's frame.
    d_agent = matrix([[-cos_a, -sin_a, -sin_a * dx + cos_a * dy],
                      [sin_a, -cos_a, -cos_a * dx - sin_a * dy],
                      [zero, zero, -one]])
    d_landmark = matrix([[cos_a, sin_a, zero], [-sin_a, cos_a, zero], [zero, zero, one]])
    rotate = matrix([[cos_m, sin_m, zero], [-sin_m, cos_m, zero], [zero, zero, one]])
    return rotate @ d_agent, rotate @ d_landmark


def chi2(agents: torch.Tensor, landmarks: torch.Tensor, graph: GraphBatch) -> torch.Tensor:
    """Estimates -> (B,) sum over edges of e' Omega e."""
    residual = edge_residuals(agents, landmarks, graph)
    return (residual * residual * graph.information).sum(dim=(1, 2))


@dataclass
class NormalEquations:
    """The Gauss-Newton system H dx = b (b = -J' Omega e, g2o's sign) in its blocks: an edge joins
    one agent and one landmark, so H's agent-agent and landmark-landmark parts are block
    diagonal. ``agent_diag`` (B, A, 3, 3), ``landmark_diag`` (B, L, 3, 3), ``coupling``
    (B, A, L, 3, 3) the agent-landmark blocks, ``b_agent`` (B, A, 3), ``b_landmark`` (B, L, 3).
    A fixed or padding vertex has an identity diagonal block, no coupling and b = 0."""
    agent_diag: torch.Tensor
    landmark_diag: torch.Tensor
    coupling: torch.Tensor
    b_agent: torch.Tensor
    b_landmark: torch.Tensor

    def dense(self) -> torch.Tensor:
        """(B, 3(A + L), 3(A + L)) the whole H, agents first (for tests and inspection)."""
        batch, agents, landmarks = self.coupling.shape[:3]
        top = torch.cat([_block_diag(self.agent_diag), _blocks(self.coupling)], dim=2)
        bottom = torch.cat([_blocks(self.coupling).transpose(1, 2),
                            _block_diag(self.landmark_diag)], dim=2)
        return torch.cat([top, bottom], dim=1)


def _blocks(blocks: torch.Tensor) -> torch.Tensor:
    """(B, R, C, 3, 3) blocks -> (B, 3R, 3C)."""
    batch, rows, cols = blocks.shape[:3]
    return blocks.permute(0, 1, 3, 2, 4).reshape(batch, 3 * rows, 3 * cols)


def _block_diag(blocks: torch.Tensor) -> torch.Tensor:
    """(B, R, 3, 3) diagonal blocks -> (B, 3R, 3R)."""
    eye = torch.eye(blocks.shape[1], dtype=blocks.dtype)
    return _blocks(eye[None, :, :, None, None] * blocks[:, :, None])


def normal_equations(agents: torch.Tensor, landmarks: torch.Tensor,
                     graph: GraphBatch) -> NormalEquations:
    """Linearise every edge at the estimates and sum the blocks per vertex (pair)."""
    batch, num_agents, num_landmarks = agents.shape[0], agents.shape[1], landmarks.shape[1]
    residual = edge_residuals(agents, landmarks, graph)
    d_agent, d_landmark = edge_jacobians(agents, landmarks, graph)
    omega = graph.information[..., :, None]                 # (B, E, 3, 1): Omega is diagonal
    agent_t, landmark_t = d_agent.transpose(-1, -2), d_landmark.transpose(-1, -2)

    def sum_blocks(values, index, count):
        out = values.new_zeros((batch, count) + values.shape[2:])
        return out.index_put_((torch.arange(batch)[:, None], index), values, accumulate=True)

    agent_diag = sum_blocks(agent_t @ (omega * d_agent), graph.edge_agent, num_agents)
    landmark_diag = sum_blocks(landmark_t @ (omega * d_landmark), graph.edge_landmark,
                               num_landmarks)
    pair = graph.edge_agent * num_landmarks + graph.edge_landmark
    coupling = sum_blocks(agent_t @ (omega * d_landmark), pair, num_agents * num_landmarks)
    weighted = omega[..., 0] * residual
    b_agent = -sum_blocks((agent_t @ weighted[..., None])[..., 0], graph.edge_agent, num_agents)
    b_landmark = -sum_blocks((landmark_t @ weighted[..., None])[..., 0], graph.edge_landmark,
                             num_landmarks)

    agent_free = graph.agent_free.to(agents.dtype)
    landmark_free = graph.landmark_free.to(agents.dtype)
    eye = torch.eye(3, dtype=agents.dtype)
    coupling = coupling.view(batch, num_agents, num_landmarks, 3, 3)
    coupling = coupling * (agent_free[:, :, None] * landmark_free[:, None, :])[..., None, None]
    return NormalEquations(
        agent_diag=torch.where(graph.agent_free[..., None, None], agent_diag, eye),
        landmark_diag=torch.where(graph.landmark_free[..., None, None], landmark_diag, eye),
        coupling=coupling, b_agent=b_agent * agent_free[..., None],
        b_landmark=b_landmark * landmark_free[..., None])


def damped_step(system: NormalEquations, damping: torch.Tensor):
    """Solve (H + lambda I) dx = b exactly by eliminating the landmarks (Schur complement on the
    block-diagonal landmark part; the reduced agent system is dense).

    (B,) lambda -> dx of the agents (B, A, 3) and of the landmarks (B, L, 3), zero where a
    factorisation failed, and (B,) bool whether it succeeded.
    """
    eye3 = torch.eye(3, dtype=damping.dtype)
    lam = damping[:, None, None, None] * eye3
    landmark_inv, landmark_info = torch.linalg.inv_ex(system.landmark_diag + lam)
    coupling_w = system.coupling @ landmark_inv[:, None]             # C D_l^-1 (B, A, L, 3, 3)
    batch, num_agents = system.b_agent.shape[:2]
    reduced = _block_diag(system.agent_diag + lam) - torch.einsum(
        "balij,bclkj->baick", coupling_w, system.coupling).reshape(batch, 3 * num_agents, -1)
    rhs = system.b_agent - torch.einsum("balij,blj->bai", coupling_w, system.b_landmark)
    factor, reduced_info = torch.linalg.cholesky_ex(reduced)
    solved = (reduced_info == 0) & (landmark_info == 0).all(dim=1)
    eye = torch.eye(3 * num_agents, dtype=damping.dtype)
    factor = torch.where(solved[:, None, None], factor, eye)       # a failed one: any PD matrix
    step_agent = torch.cholesky_solve(rhs.reshape(batch, -1, 1), factor).view(batch, num_agents, 3)
    back = system.b_landmark - torch.einsum("balji,baj->bli", system.coupling, step_agent)
    step_landmark = (landmark_inv @ back[..., None])[..., 0]
    keep = solved[:, None, None]
    return (torch.where(keep, step_agent, torch.zeros_like(step_agent)),
            torch.where(keep, step_landmark, torch.zeros_like(step_landmark)), solved)


# g2o OptimizationAlgorithmLevenberg's constants.
_TAU = 1e-5                 # initial lambda = tau * max diagonal of H over the free vertices
_MAX_TRIALS = 10            # failed trials in one iteration before giving up
_GOOD_STEP_LOWER, _GOOD_STEP_UPPER = 1 / 3, 2 / 3


@dataclass
class SolveResult:
    """``agents`` (B, A, 3) and ``landmarks`` (B, L, 3) the optimised estimates; ``iterations``
    (B,) accepted LM steps; ``chi2_start`` / ``chi2_end`` (B,)."""
    agents: torch.Tensor
    landmarks: torch.Tensor
    iterations: torch.Tensor
    chi2_start: torch.Tensor
    chi2_end: torch.Tensor


def initial_damping(system: NormalEquations, graph: GraphBatch) -> torch.Tensor:
    """(B,) g2o's first lambda: tau times the largest diagonal entry of H over free vertices."""
    agent = torch.diagonal(system.agent_diag, dim1=-2, dim2=-1) * graph.agent_free[..., None]
    landmark = (torch.diagonal(system.landmark_diag, dim1=-2, dim2=-1)
                * graph.landmark_free[..., None])
    return _TAU * torch.maximum(agent.flatten(1).amax(1), landmark.flatten(1).amax(1))


def levenberg_marquardt(graph: GraphBatch, max_iterations: int = 1000,
                        relative_tolerance: float = 1e-12) -> SolveResult:
    """Minimise every sample's chi2 at once, g2o's Levenberg schedule per sample.

    One loop pass is one trial for each active sample: solve (H + lambda I) dx = b; accept when
    the gain ratio rho > 0 (lambda *= clamp(1 - (2 rho - 1)^3, 1/3, 2/3), nu = 2) or reject
    (lambda *= nu, nu *= 2). A sample stops after ``max_iterations`` accepted steps,
    ``_MAX_TRIALS`` failed trials in a row, a step that leaves chi2 unchanged (rho == 0), or an
    accepted step that lowers chi2 by no more than ``relative_tolerance`` of it or leaves it
    below ``relative_tolerance`` of its start (an exact fit).
    """
    agents, landmarks = graph.agents.clone(), graph.landmarks.clone()
    batch = agents.shape[0]
    current = chi2(agents, landmarks, graph)
    start = current.clone()
    system = normal_equations(agents, landmarks, graph)
    damping = initial_damping(system, graph)
    nu = torch.full((batch,), 2.0, dtype=torch.float64)
    trials = torch.zeros(batch, dtype=torch.long)
    iterations = torch.zeros(batch, dtype=torch.long)
    active = graph.agent_free.any(dim=1) & (current > 0)
    while bool(active.any()):
        step_agent, step_landmark, solved = damped_step(system, damping)
        new_agents, new_landmarks = _moved(agents, step_agent), _moved(landmarks, step_landmark)
        new = chi2(new_agents, new_landmarks, graph)
        scale = (step_agent * (damping[:, None, None] * step_agent + system.b_agent)).sum((1, 2))
        scale += (step_landmark * (damping[:, None, None] * step_landmark
                                   + system.b_landmark)).sum((1, 2))
        rho = (current - new) / (scale + 1e-3)
        accept = active & solved & (rho > 0) & torch.isfinite(new)
        reject = active & ~accept
        trials = trials + active.long()

        # Converged: the gain is round-off, or the fit is exact (chi2 ~ 0 would otherwise keep
        # halving at float64's bottom until the iteration cap).
        small_gain = accept & ((current - new <= relative_tolerance * current)
                               | (new <= relative_tolerance * start))
        alpha = (1 - (2 * rho - 1) ** 3).clamp(_GOOD_STEP_LOWER, _GOOD_STEP_UPPER)
        damping = torch.where(accept, damping * alpha, torch.where(reject, damping * nu, damping))
        nu = torch.where(accept, torch.full_like(nu, 2.0), torch.where(reject, nu * 2, nu))
        agents = torch.where(accept[:, None, None], new_agents, agents)
        landmarks = torch.where(accept[:, None, None], new_landmarks, landmarks)
        current = torch.where(accept, new, current)
        iterations = iterations + accept.long()

        stop = (trials >= _MAX_TRIALS) | (active & solved & (rho == 0)) | small_gain
        stop |= iterations >= max_iterations
        trials = torch.where(accept, torch.zeros_like(trials), trials)
        active = active & ~stop
        if bool((accept & active).any()):
            system = normal_equations(agents, landmarks, graph)
    return SolveResult(agents, landmarks, iterations, start, current)


def _moved(estimate: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """(B, V, 3) estimates plus (B, V, 3) additive steps, yaw wrapped."""
    moved = estimate + step
    return torch.cat([moved[..., :2], wrap_angle(moved[..., 2:])], dim=-1)


# -- the public entry point ---------------------------------------------------------------------

@dataclass
class AlignResult:
    """``poses`` (N, 3) corrected (x, y, yaw) of every agent, the samples' agents consecutive;
    per sample: ``status`` (SOLVED or why the input was kept), ``num_landmarks`` (clusters),
    ``iterations`` (accepted LM steps, 0 when not solved)."""
    poses: torch.Tensor
    status: List[str]
    num_landmarks: List[int]
    iterations: List[int]


def align_poses(boxes: Sequence[torch.Tensor], log_vars: Optional[Sequence[torch.Tensor]],
                poses: torch.Tensor, record_len: Sequence[int],
                args: BoxAlignArgs = BoxAlignArgs()) -> AlignResult:
    """Correct the agents' poses from their detections (CoAlign's box alignment), batch of samples.

    boxes: per agent (N_a, 3) detections (x, y, yaw) in its own frame, all agents of all samples
    in order; log_vars: the same shapes (predicted log variances of the x, y, yaw regression
    targets) or None; poses (N, 3) noisy world (x, y, yaw), the ego first in each sample;
    record_len: agents per sample. Returns an :class:`AlignResult`; the ego's pose never moves,
    and a sample that is not solved keeps its input poses exactly.
    """
    record_len = [int(n) for n in record_len]
    starts = [sum(record_len[:i]) for i in range(len(record_len))]
    graphs = [build_sample_graph(boxes[s:s + n], None if log_vars is None else log_vars[s:s + n],
                                 poses[s:s + n], args)
              for s, n in zip(starts, record_len)]
    corrected = poses.detach().clone()
    iterations = [0] * len(graphs)
    to_solve = [i for i, g in enumerate(graphs) if g.status == SOLVED]
    if to_solve:
        result = levenberg_marquardt(stack_graphs([graphs[i] for i in to_solve]),
                                     args.max_iterations, args.relative_tolerance)
        for row, i in enumerate(to_solve):
            count = record_len[i]
            corrected[starts[i]:starts[i] + count] = result.agents[row, :count].to(corrected)
            iterations[i] = int(result.iterations[row])
    return AlignResult(corrected, [g.status for g in graphs],
                       [g.num_landmarks for g in graphs], iterations)


# -- between the detector's poses and the solver's ----------------------------------------------

def planar_poses(lidar_poses: torch.Tensor) -> torch.Tensor:
    """(N, 6) CARLA poses ``[x, y, z, roll, yaw, pitch]`` (m, deg) -> (N, 3) (x, y, yaw rad)."""
    return torch.stack([lidar_poses[:, 0], lidar_poses[:, 1],
                        torch.deg2rad(lidar_poses[:, 4])], dim=1)


def with_planar(lidar_poses: torch.Tensor, planar: torch.Tensor) -> torch.Tensor:
    """(N, 6) CARLA poses with x, y and yaw replaced by (N, 3) corrected (x, y, yaw rad); z, roll
    and pitch are kept (the pose graph is planar, as the authors')."""
    corrected = lidar_poses.clone()
    corrected[:, 0], corrected[:, 1] = planar[:, 0].to(corrected), planar[:, 1].to(corrected)
    corrected[:, 4] = torch.rad2deg(planar[:, 2]).to(corrected)
    return corrected


def planar_pairwise(planar: torch.Tensor, record_len: Sequence[int],
                    max_agents: int) -> torch.Tensor:
    """(N, 3) world (x, y, yaw rad), agents per sample -> (B, L, L, 4, 4) entry [b, i, j] the
    transform taking agent j's frame into agent i's (inv(T_i) @ T_j; identity on padding), the
    ``pairwise`` a warping fusion (V2VNet's ``forward``) takes."""
    frames = planar_matrices(planar)
    out = torch.eye(4, dtype=planar.dtype, device=planar.device).repeat(
        len(record_len), max_agents, max_agents, 1, 1)
    start = 0
    for b, count in enumerate(int(n) for n in record_len):
        sample = frames[start:start + count]
        out[b, :count, :count] = torch.linalg.inv(sample)[:, None] @ sample[None, :]
        start += count
    return out


def box_align_lidar_poses(boxes_7dof: Sequence[torch.Tensor],
                          log_vars: Optional[Sequence[torch.Tensor]], lidar_poses: torch.Tensor,
                          record_len: Sequence[int],
                          args: BoxAlignArgs = BoxAlignArgs()) -> torch.Tensor:
    """The authors' ``box_alignment_relative_np`` on our layouts: per agent (N_a, 7) decoded boxes
    ``[x, y, z, *sizes, yaw]`` in its own frame (either size order: only x, y and yaw are read),
    their (N_a, 3) log variances or None, (N, 6) CARLA lidar poses (m, deg) -> (N, 6) the poses
    with x, y and yaw corrected (:func:`align_poses`), ready for pairwise transforms."""
    planar_boxes = [boxes[:, [0, 1, 6]] for boxes in boxes_7dof]
    result = align_poses(planar_boxes, log_vars, planar_poses(lidar_poses.double()), record_len,
                         args)
    return with_planar(lidar_poses, result.poses)


def planar_matrices(planar: torch.Tensor) -> torch.Tensor:
    """(N, 3) (x, y, yaw rad) -> (N, 4, 4) frame -> world transforms (z, roll, pitch zero)."""
    cos, sin = torch.cos(planar[:, 2]), torch.sin(planar[:, 2])
    frames = torch.eye(4, dtype=planar.dtype, device=planar.device).repeat(len(planar), 1, 1)
    frames[:, 0, 0], frames[:, 0, 1], frames[:, 1, 0], frames[:, 1, 1] = cos, -sin, sin, cos
    frames[:, 0, 3], frames[:, 1, 3] = planar[:, 0], planar[:, 1]
    return frames


def planar_of_transforms(transforms: torch.Tensor) -> torch.Tensor:
    """(N, 4, 4) frame -> world (or agent -> ego) transforms -> (N, 3) float64 planar poses
    (x, y in metres, yaw in radians; z, roll and pitch dropped)."""
    matrices = transforms.double()
    return torch.stack([matrices[:, 0, 3], matrices[:, 1, 3],
                        torch.atan2(matrices[:, 1, 0], matrices[:, 0, 0])], dim=1)


def box_align_transforms_to_ego(transforms_to_ego: torch.Tensor,
                                boxes_7dof: Sequence[torch.Tensor],
                                log_vars: Optional[Sequence[torch.Tensor]],
                                record_len: Sequence[int],
                                args: BoxAlignArgs = BoxAlignArgs()) -> torch.Tensor:
    """Pose correction where only agent -> ego transforms are known (a batch's
    ``transforms_to_ego`` (N, 4, 4), noisy for non-ego agents): the ego frame is the pose
    graph's world (the ego's transform is the identity), the boxes are each agent's own-frame
    detections (N_a, 7). -> (N, 4, 4) the transforms with their planar part corrected (a
    correction D = P_new inv(P_old) applied on the ego side keeps z, roll and pitch)."""
    matrices = transforms_to_ego.double()
    planar = planar_of_transforms(matrices)
    planar_boxes = [boxes[:, [0, 1, 6]] for boxes in boxes_7dof]
    corrected = align_poses(planar_boxes, log_vars, planar, record_len, args).poses
    correction = planar_matrices(corrected) @ torch.linalg.inv(planar_matrices(planar))
    return (correction @ matrices).to(transforms_to_ego)
