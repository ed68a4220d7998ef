"""CoAlign's agent-object pose graph (opencood/ops/pose_graph.py) on constructed scenes: known
poses recovered, the LM optimum against a plain dense Gauss-Newton, batching against one sample
at a time, the Jacobians against autograd, and each of the authors' fallbacks."""
import math

import torch

from opencood.ops import pose_graph as pg
from opencood.ops.pose_graph import BoxAlignArgs, align_poses
from opencood.testing.pose_graph_scene import make_pose_graph_scene

F64 = torch.float64


def make_scene(num_agents=4, num_objects=12, pose_noise=0.5, box_noise=0.0, seed=0):
    """Objects on a 6 m grid, every agent sees all: opencood/testing/pose_graph_scene.py."""
    return make_pose_graph_scene(num_agents, num_objects, pose_noise, box_noise, seed)


def test_exact_boxes_recover_the_true_poses():
    true, noisy, boxes = make_scene(pose_noise=0.5)
    result = align_poses(boxes, None, noisy, [len(noisy)])
    assert result.status == [pg.SOLVED] and result.num_landmarks == [12]
    assert (noisy - true).abs().max() > 0.3
    torch.testing.assert_close(result.poses, true, atol=1e-6, rtol=0)


def test_noisy_boxes_recover_the_poses_within_what_the_edges_allow():
    # 12 boxes per agent, 2 cm box noise: the pose error shrinks to a few cm / a tenth of a
    # degree from up to 0.5 m / 0.5 deg.
    true, noisy, boxes = make_scene(pose_noise=0.5, box_noise=0.02, seed=1)
    error = (align_poses(boxes, None, noisy, [len(noisy)]).poses - true).abs()
    assert error[0].max() == 0                      # the ego is fixed
    assert error[:, :2].max() < 0.05 and error[:, 2].max() < math.radians(0.2)


def dense_gauss_newton(graph: pg.SampleGraph, iterations=30):
    """The reference: residuals from 3x3 homogeneous matrices, a central-difference Jacobian of
    all free parameters (agents 1.., landmarks) and full Gauss-Newton steps."""
    def matrix(pose):
        c, s = torch.cos(pose[2]), torch.sin(pose[2])
        return torch.stack([torch.stack([c, -s, pose[0]]), torch.stack([s, c, pose[1]]),
                            torch.tensor([0.0, 0.0, 1.0], dtype=F64)])

    def residuals(params):
        agents = torch.cat([graph.agents[:1], params[:3 * (len(graph.agents) - 1)].view(-1, 3)])
        landmarks = params[3 * (len(graph.agents) - 1):].view(-1, 3)
        rows = []
        for a, k, z, info in zip(graph.edge_agent, graph.edge_landmark, graph.measurement,
                                 graph.information):
            error = torch.linalg.inv(matrix(z)) @ torch.linalg.inv(matrix(agents[a])) \
                @ matrix(landmarks[k])
            vector = torch.stack([error[0, 2], error[1, 2], torch.atan2(error[1, 0], error[0, 0])])
            rows.append(info.sqrt() * vector)
        return torch.cat(rows)

    params = torch.cat([graph.agents[1:].flatten(), graph.landmarks.flatten()])
    for _ in range(iterations):
        step = 1e-6
        jacobian = torch.stack([(residuals(params + step * e) - residuals(params - step * e))
                                / (2 * step) for e in torch.eye(len(params), dtype=F64)], dim=1)
        params = params - torch.linalg.lstsq(jacobian, residuals(params)[:, None]).solution[:, 0]
    return params[:3 * (len(graph.agents) - 1)].view(-1, 3)


def test_lm_equals_a_dense_least_squares_reference():
    true, noisy, boxes = make_scene(num_agents=3, num_objects=5, pose_noise=0.8, box_noise=0.05)
    graph = pg.build_sample_graph(boxes, None, noisy, BoxAlignArgs(min_landmarks=0))
    graph.information = torch.rand(len(graph.information), 3, dtype=F64,
                                   generator=torch.Generator().manual_seed(3)) * 4 + 0.5
    solved = pg.levenberg_marquardt(pg.stack_graphs([graph]))
    torch.testing.assert_close(solved.agents[0, 1:], dense_gauss_newton(graph), atol=1e-7, rtol=0)
    assert solved.chi2_end[0] < solved.chi2_start[0]


def test_normal_equations_match_autograd():
    _, noisy, boxes = make_scene(num_agents=3, num_objects=4, pose_noise=0.5, box_noise=0.1)
    batch = pg.stack_graphs([pg.build_sample_graph(boxes, None, noisy, BoxAlignArgs())])
    batch.information = torch.rand_like(batch.information) + 0.5
    agents, landmarks = batch.agents, batch.landmarks

    def weighted(agent_params, landmark_params):
        return (pg.edge_residuals(agent_params, landmark_params, batch)
                * batch.information.sqrt()).flatten()

    jac_agents, jac_landmarks = torch.autograd.functional.jacobian(weighted, (agents, landmarks))
    jacobian = torch.cat([jac_agents.flatten(1), jac_landmarks.flatten(1)], dim=1)
    free = torch.cat([batch.agent_free.repeat_interleave(3, 1),
                      batch.landmark_free.repeat_interleave(3, 1)], dim=1)[0]
    jacobian = jacobian[:, free]
    system = pg.normal_equations(agents, landmarks, batch)
    dense = system.dense()[0][free][:, free]
    torch.testing.assert_close(dense, jacobian.T @ jacobian)
    b = torch.cat([system.b_agent.flatten(), system.b_landmark.flatten()])[free]
    torch.testing.assert_close(b, -jacobian.T @ weighted(agents, landmarks))


def test_batched_samples_equal_samples_solved_alone():
    scenes = [make_scene(num_agents=n, num_objects=k, pose_noise=0.5, box_noise=0.03, seed=s)
              for n, k, s in [(4, 12, 0), (2, 6, 1), (3, 9, 2)]]
    boxes = [b for _, _, scene_boxes in scenes for b in scene_boxes]
    poses = torch.cat([noisy for _, noisy, _ in scenes])
    together = align_poses(boxes, None, poses, [4, 2, 3])
    alone = torch.cat([align_poses(b, None, noisy, [len(noisy)]).poses for _, noisy, b in scenes])
    assert together.status == [pg.SOLVED] * 3
    torch.testing.assert_close(together.poses, alone, atol=1e-9, rtol=0)


def test_uncertainty_weights_boxes_with_the_anchor_diagonal():
    info = pg.box_information(torch.zeros(2, 3, dtype=F64), 2)
    torch.testing.assert_close(info, torch.tensor([[1 / 17.77, 1 / 17.77, 1.0]] * 2, dtype=F64))
    # Certain boxes pull the pose to themselves: both agents' boxes of object 0 are far more
    # certain than the rest, so the corrected pose explains them better than an equal-weight
    # solve does.
    true, noisy, boxes = make_scene(num_agents=2, num_objects=6, pose_noise=0.5, box_noise=0.05)
    log_vars = [torch.zeros(6, 3, dtype=F64), torch.zeros(6, 3, dtype=F64)]
    log_vars[0][0] = log_vars[1][0] = -8.0
    plain = align_poses(boxes, None, noisy, [2]).poses
    weighted = align_poses(boxes, log_vars, noisy, [2]).poses
    unused = align_poses(boxes, log_vars, noisy, [2], BoxAlignArgs(use_uncertainty=False)).poses
    torch.testing.assert_close(unused, plain)

    def box_error(poses):
        landmark = pg.to_world(boxes[0][0], poses[0])      # the ego's view of object 0
        return (pg.to_local(landmark, poses[1]) - boxes[1][0])[:2].norm()
    assert box_error(weighted) < 0.1 * box_error(plain)


def test_clusters_join_only_other_agents_boxes_near_the_seed():
    centres = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.5, 0.0], [2.2, 0.0], [9.0, 9.0]], dtype=F64)
    agents = torch.tensor([0, 0, 1, 2, 1])
    # box 0 seeds with box 2 (agent 1); box 1 is agent 0's own; box 3 is 2.2 m from the seed.
    assert pg.cluster_boxes(centres, agents, 1.5) == [[0, 2], [1, 3]]


def test_few_landmarks_keep_the_input_poses():
    _, noisy, boxes = make_scene(num_agents=3, num_objects=3, pose_noise=0.5)
    result = align_poses(boxes, None, noisy, [3])
    assert result.status == [pg.FEW_LANDMARKS] and result.num_landmarks == [3]
    assert torch.equal(result.poses, noisy)
    allowed = align_poses(boxes, None, noisy, [3], BoxAlignArgs(abandon_hard_cases=False))
    assert allowed.status == [pg.SOLVED] and not torch.equal(allowed.poses, noisy)


def flip_yaws(boxes, objects, turn=math.pi / 2):
    """Turn agent 1's boxes of ``objects`` by ``turn`` (a wrong heading): their clusters
    disagree (a right angle: a half turn is the same box, see the half-turn test)."""
    boxes = [b.clone() for b in boxes]
    boxes[1][objects, 2] = pg.wrap_angle(boxes[1][objects, 2] + turn)
    return boxes


def test_a_half_turned_heading_is_the_same_box():
    true, noisy, boxes = make_scene(num_agents=3, num_objects=8, pose_noise=0.5)
    turned = flip_yaws(boxes, [0, 1, 2, 3, 4], turn=math.pi)
    result = align_poses(turned, None, noisy, [3])
    assert result.status == [pg.SOLVED]
    torch.testing.assert_close(result.poses, true, atol=1e-6, rtol=0)
    # The authors' rule: headings as detected, so most clusters disagree and the input is kept.
    authors = align_poses(turned, None, noisy, [3], BoxAlignArgs(half_turn_symmetric=False))
    assert authors.status == [pg.YAW_DISAGREEMENT] and torch.equal(authors.poses, noisy)


def test_half_the_clusters_disagreeing_in_yaw_keeps_the_input_poses():
    _, noisy, boxes = make_scene(num_agents=3, num_objects=8, pose_noise=0.5)
    result = align_poses(flip_yaws(boxes, [0, 1, 2, 3]), None, noisy, [3])
    assert result.status == [pg.YAW_DISAGREEMENT] and torch.equal(result.poses, noisy)
    assert align_poses(flip_yaws(boxes, [0, 1, 2]), None, noisy, [3]).status == [pg.SOLVED]


def test_yaw_disagreeing_clusters_are_dropped():
    true, noisy, boxes = make_scene(num_agents=3, num_objects=8, pose_noise=0.5)
    flipped = flip_yaws(boxes, [0, 1])
    graph = pg.build_sample_graph(flipped, None, noisy, BoxAlignArgs())
    assert graph.num_landmarks == 8 and graph.num_dropped == 2 and len(graph.landmarks) == 6
    # Dropped: the exact boxes of the 6 agreeing objects still give the true poses.
    torch.testing.assert_close(align_poses(flipped, None, noisy, [3]).poses, true,
                               atol=1e-6, rtol=0)
    kept = align_poses(flipped, None, noisy, [3], BoxAlignArgs(drop_hard_boxes=False)).poses
    assert (kept - true).abs().max() > 1e-3


def test_yaws_across_pi_agree():
    yaws = torch.tensor([math.pi - 0.01, -math.pi + 0.01], dtype=F64)
    assert pg.cluster_yaw_variances(yaws, [[0, 1]]).item() < 1e-3


def test_a_lone_agent_is_left_alone():
    _, noisy, boxes = make_scene(num_agents=2, num_objects=6)
    result = align_poses(boxes, None, noisy, [1, 1])
    assert result.status == [pg.SINGLE_AGENT] * 2 and torch.equal(result.poses, noisy)


def test_an_exact_fit_stops_early():
    # Exact boxes: chi2 falls to round-off within a few steps; the solver stops there instead
    # of running to the 1000-iteration cap.
    _, noisy, boxes = make_scene(pose_noise=0.5)
    assert 0 < align_poses(boxes, None, noisy, [len(noisy)]).iterations[0] < 30


def test_agents_without_boxes_and_float32_inputs():
    true, noisy, boxes = make_scene(num_agents=3, num_objects=8, pose_noise=0.4)
    boxes = [b.float() for b in boxes[:2]] + [torch.zeros(0, 3)]
    result = align_poses(boxes, None, noisy.float(), [3])
    assert result.status == [pg.SOLVED] and result.poses.dtype == torch.float32
    torch.testing.assert_close(result.poses[:2], true[:2].float(), atol=1e-4, rtol=0)
    assert torch.equal(result.poses[2], noisy[2].float())        # seen by no one: unchanged
    nothing = align_poses([torch.zeros(0, 3)] * 2, None, noisy[:2], [2])
    assert nothing.status == [pg.FEW_LANDMARKS] and nothing.num_landmarks == [0]


def test_box_align_reads_7dof_boxes_and_carla_poses():
    true, noisy, boxes = make_scene(num_agents=3, num_objects=8, pose_noise=0.4)

    def carla(planar):   # (A, 3) rad -> (A, 6) [x, y, z, roll, yaw deg, pitch]
        zeros = torch.zeros(len(planar), dtype=F64)
        return torch.stack([planar[:, 0], planar[:, 1], zeros + 1.7, zeros,
                            torch.rad2deg(planar[:, 2]), zeros], dim=1)

    boxes_7dof = [torch.cat([b[:, :2], torch.full((len(b), 1), -1.0, dtype=F64),
                             torch.tensor([[1.5, 1.8, 4.2]], dtype=F64).expand(len(b), 3),
                             b[:, 2:]], dim=1) for b in boxes]
    corrected = pg.box_align_lidar_poses(boxes_7dof, None, carla(noisy).float(), [3])
    assert corrected.dtype == torch.float32
    torch.testing.assert_close(corrected, carla(true).float(), atol=1e-4, rtol=0)


def test_box_align_corrects_transforms_to_ego_and_keeps_height():
    # The batch only knows agent -> ego transforms: the ego frame is the world, the ego's
    # transform the identity; a 1.7 m height offset must survive the correction.
    true, noisy, boxes = make_scene(num_agents=3, num_objects=8, pose_noise=0.4)
    boxes_7dof = [torch.cat([b[:, :2], torch.zeros(len(b), 4, dtype=F64), b[:, 2:]], dim=1)
                  for b in boxes]

    def transforms(planar):
        matrices = pg.planar_matrices(planar)
        matrices[1:, 2, 3] = 1.7
        return matrices.float()

    corrected = pg.box_align_transforms_to_ego(transforms(noisy), boxes_7dof, None, [3])
    assert corrected.dtype == torch.float32
    torch.testing.assert_close(corrected, transforms(true), atol=1e-4, rtol=0)


# -- the authors' other switches ----------------------------------------------------------------

def dense_point_landmarks(graph: pg.SampleGraph, iterations=30):
    """The reference for ``landmark_SE2: false``: g2o's EdgeSE2PointXY written out, R_a' (l - t_a)
    - z with (x, y) landmarks and a 2-row residual per edge, central differences and full
    Gauss-Newton steps."""
    num_free = len(graph.agents) - 1

    def residuals(params):
        agents = torch.cat([graph.agents[:1], params[:3 * num_free].view(-1, 3)])
        points = params[3 * num_free:].view(-1, 2)
        rows = []
        for a, k, z, info in zip(graph.edge_agent, graph.edge_landmark, graph.measurement,
                                 graph.information):
            c, s = torch.cos(agents[a, 2]), torch.sin(agents[a, 2])
            dx, dy = points[k] - agents[a, :2]
            seen = torch.stack([c * dx + s * dy, -s * dx + c * dy])
            rows.append(info[:2].sqrt() * (seen - z[:2]))
        return torch.cat(rows)

    params = torch.cat([graph.agents[1:].flatten(), graph.landmarks[:, :2].flatten()])
    for _ in range(iterations):
        step = 1e-6
        jacobian = torch.stack([(residuals(params + step * e) - residuals(params - step * e))
                                / (2 * step) for e in torch.eye(len(params), dtype=F64)], dim=1)
        params = params - torch.linalg.lstsq(jacobian, residuals(params)[:, None]).solution[:, 0]
    return params[:3 * num_free].view(-1, 3)


def test_point_landmarks_equal_the_point_edge_reference_and_ignore_headings():
    true, noisy, boxes = make_scene(num_agents=3, num_objects=5, pose_noise=0.8, box_noise=0.05)
    args = BoxAlignArgs(min_landmarks=0, landmark_SE2=False)
    graph = pg.build_sample_graph(boxes, None, noisy, args)
    assert (graph.information[:, 2] == 0).all() and (graph.measurement[:, 2] == 0).all()
    graph.information[:, :2] = torch.rand(len(graph.information), 2, dtype=F64,
                                          generator=torch.Generator().manual_seed(3)) * 4 + 0.5
    solved = pg.levenberg_marquardt(pg.stack_graphs([graph]))
    torch.testing.assert_close(solved.agents[0, 1:], dense_point_landmarks(graph),
                               atol=1e-7, rtol=0)
    # Exact centres, 7 of 12 headings wrong by a right angle, every cluster kept: point
    # landmarks recover the true poses, SE(2) landmarks are pulled by the wrong headings.
    true, noisy, boxes = make_scene(pose_noise=0.5)
    wrong = flip_yaws(boxes, [0, 1, 2, 3, 4, 5, 6])
    keep_all = dict(abandon_hard_cases=False, drop_hard_boxes=False)
    points = align_poses(wrong, None, noisy, [4], BoxAlignArgs(landmark_SE2=False, **keep_all))
    torch.testing.assert_close(points.poses, true, atol=1e-6, rtol=0)
    se2 = align_poses(wrong, None, noisy, [4], BoxAlignArgs(**keep_all))
    assert (se2.poses - true).abs().max() > 1e-2


def test_adaptive_landmarks_make_yaw_disagreeing_clusters_points_of_double_weight():
    _, noisy, boxes = make_scene(num_agents=3, num_objects=8, pose_noise=0.5)
    flipped = flip_yaws(boxes, [0, 1])
    args = BoxAlignArgs(adaptive_landmark=True, drop_hard_boxes=False)
    graph = pg.build_sample_graph(flipped, None, noisy, args)
    point = graph.information[:, 2] == 0
    assert graph.num_dropped == 0 and int(point.sum()) == 2 * 3     # 2 objects x 3 agents
    torch.testing.assert_close(graph.information[point, :2], torch.full((6, 2), 2.0, dtype=F64))
    assert (graph.information[~point] == 1).all()
    # Without adaptive landmarks the same clusters keep their (wrong) yaw edges.
    assert (pg.build_sample_graph(flipped, None, noisy, BoxAlignArgs(drop_hard_boxes=False))
            .information[:, 2] > 0).all()


def test_normalised_and_unsure_information_with_the_uncertainty_head():
    _, noisy, boxes = make_scene(num_agents=2, num_objects=6, pose_noise=0.5)
    log_vars = [torch.full((6, 3), -4.0, dtype=F64), torch.full((6, 3), -4.0, dtype=F64)]
    log_vars[1][0] = 2.0            # one box: information sum far below 100
    plain = pg.build_sample_graph(boxes, log_vars, noisy, BoxAlignArgs())
    sqrt = pg.build_sample_graph(boxes, log_vars, noisy, BoxAlignArgs(normalize_uncertainty=True))
    torch.testing.assert_close(sqrt.information, plain.information.sqrt())
    unsure = pg.build_sample_graph(boxes, log_vars, noisy, BoxAlignArgs(drop_unsure_edge=True))
    # information of a sure box: e^4 (1 + 2 / 17.77) = 60.7 < 100 as well, so e^4 -> e^5
    assert len(unsure.edge_agent) == len(plain.edge_agent) - 12      # every box under 100
    log_vars = [v - 1.0 for v in log_vars]
    unsure = pg.build_sample_graph(boxes, log_vars, noisy, BoxAlignArgs(drop_unsure_edge=True))
    assert len(unsure.edge_agent) == len(plain.edge_agent) - 1
    # Without the uncertainty head the authors never drop (their information is the identity).
    no_head = pg.build_sample_graph(boxes, None, noisy, BoxAlignArgs(drop_unsure_edge=True))
    assert len(no_head.edge_agent) == len(plain.edge_agent)
