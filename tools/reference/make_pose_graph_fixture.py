#!/usr/bin/env python
"""The pose-graph parity fixture: CoAlign's own box alignment (``box_align_v2.py`` and
``pose_graph_optim.py``, solved by g2o) on constructed and real stage-1 boxes, for
``tests/test_pose_graph_parity.py``.

Run it in the side environment, outside this checkout (our ``opencood`` would shadow theirs),
with g2o's Python wheel and a checkout of CoAlign's sources::

    pip install "numpy<2" torch matplotlib shapely pyquaternion g2o-python==0.0.12
    # (g2o-python 0.0.12's wheel crashes in EdgeSE2.set_information under numpy 2)
    git --git-dir <CoAlign mirror> archive --format=tar HEAD opencood | tar -x -C /tmp/CoAlign
    cd /tmp && python /path/to/repo/tools/reference/make_pose_graph_fixture.py \\
        --source /tmp/CoAlign --real /tmp/real_cases.json \\
        --out /path/to/repo/tests/fixtures/coalign_pose_graph.json

``--real``: samples of a real stage 1 (JSON, as this script's cases: per agent ``boxes``
(K, 7) ``[x, y, z, l, w, h, yaw]`` in its own frame and ``log_vars`` (K, 3); ``lidar_poses``
(N, 6) CARLA poses, the ego first), written by ``export_stage1_cases.py``; the committed ones
are our 30-epoch stage 1 (``point_pillar_uncertainty.yaml``) on the synthetic ``small`` test
split at 0.6 m / 0.6 deg noise. CI never runs this script.

Every case keeps away from the three places where we deliberately differ from the authors
(``opencood/ops/pose_graph.py``): poses at one height with boxes at one height (their 3-D
clustering distance is then our BEV one), no yaw straddling +-pi inside a cluster (their raw
``np.var``), and ``half_turn_symmetric: false`` in our call (their headings as detected).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np

ANCHOR = (3.9, 1.6, 1.5)          # l, w, h of every constructed box (the authors' anchor)


def import_box_align(source: Path):
    """CoAlign's ``box_alignment_relative_sample_np`` from a checkout of its sources (its
    debug-print import ``icecream`` stubbed where missing)."""
    sys.path.insert(0, str(source.resolve()))
    if importlib.util.find_spec("icecream") is None:
        sys.modules["icecream"] = types.ModuleType("icecream")
        sys.modules["icecream"].ic = print
    import opencood
    if not Path(opencood.__file__).resolve().is_relative_to(source.resolve()):
        raise SystemExit(f"error: 'opencood' resolves to {opencood.__file__}, not {source}; "
                         "run from outside the repository")
    from opencood.models.sub_modules.box_align_v2 import box_alignment_relative_sample_np
    from opencood.utils.box_utils import boxes_to_corners_3d
    return box_alignment_relative_sample_np, boxes_to_corners_3d


def to_local(world: np.ndarray, pose: np.ndarray) -> np.ndarray:
    """(K, 3) world (x, y, yaw), a (3,) planar pose -> (K, 3) in that frame."""
    cos, sin = np.cos(pose[2]), np.sin(pose[2])
    dx, dy = world[:, 0] - pose[0], world[:, 1] - pose[1]
    return np.stack([cos * dx + sin * dy, -sin * dx + cos * dy, world[:, 2] - pose[2]], axis=1)


def constructed_case(rng: np.random.Generator, num_agents: int, num_objects: int,
                     box_noise: float, turned: int = 0) -> dict:
    """Objects on a 6 m grid (headings within +-2.5 rad), agents within 15 m of the ego, every
    agent sees every object with Gaussian ``box_noise``; ``turned`` objects are seen by agent 1
    a right angle off (their clusters disagree in yaw). Pose noise 0.5 m / 0.5 deg, uniform."""
    true = np.zeros((num_agents, 3))
    true[1:, :2] = rng.uniform(-15, 15, (num_agents - 1, 2))
    true[1:, 2] = rng.uniform(-0.5, 0.5, num_agents - 1)
    side = int(np.ceil(np.sqrt(num_objects * 1.5)))
    cells = rng.permutation(side * side)[:num_objects]
    objects = np.stack([(cells % side) * 6.0 - 3.0 * (side - 1), (cells // side) * 6.0
                        - 3.0 * (side - 1), rng.uniform(-2.5, 2.5, num_objects)], axis=1)
    agents = []
    for a in range(num_agents):
        local = to_local(objects, true[a]) + rng.normal(0, box_noise, (num_objects, 3))
        if a == 1:
            local[:turned, 2] += np.pi / 2
        boxes = np.concatenate([local[:, :2], np.full((num_objects, 1), -1.0),
                                np.tile(ANCHOR, (num_objects, 1)), local[:, 2:]], axis=1)
        log_vars = rng.uniform(-6.0, -2.0, (num_objects, 3))
        agents.append({"boxes": boxes.tolist(), "log_vars": log_vars.tolist()})
    noisy = true.copy()
    noisy[1:] += rng.uniform(-1, 1, (num_agents - 1, 3)) * [0.5, 0.5, np.radians(0.5)]
    poses = [[p[0], p[1], 0.0, 0.0, float(np.degrees(p[2])), 0.0] for p in noisy]
    return {"agents": agents, "lidar_poses": poses}


def cases_to_run(real: list) -> list:
    """(name, case, the authors' keyword arguments) of every fixture case."""
    rng = np.random.default_rng(0)
    theirs = dict(landmark_SE2=True, adaptive_landmark=False, normalize_uncertainty=False,
                  abandon_hard_cases=True, drop_hard_boxes=True, use_uncertainty=True)
    out = [("solved", constructed_case(rng, 3, 12, 0.05), theirs),
           ("solved_two_agents", constructed_case(rng, 2, 8, 0.05), theirs),
           ("few_landmarks", constructed_case(rng, 3, 3, 0.05), theirs),
           ("yaw_disagreement", constructed_case(rng, 3, 8, 0.02, turned=4), theirs),
           ("some_clusters_dropped", constructed_case(rng, 3, 10, 0.05, turned=2), theirs),
           ("point_landmarks", constructed_case(rng, 3, 10, 0.05),
            {**theirs, "landmark_SE2": False}),
           ("adaptive_landmarks", constructed_case(rng, 3, 10, 0.05, turned=2),
            {**theirs, "adaptive_landmark": True, "drop_hard_boxes": False}),
           ("normalised_uncertainty", constructed_case(rng, 3, 10, 0.05),
            {**theirs, "normalize_uncertainty": True}),
           ("unsure_edges_dropped", constructed_case(rng, 4, 10, 0.05),
            {**theirs, "drop_unsure_edge": True}),
           ("no_uncertainty", constructed_case(rng, 3, 10, 0.05),
            {**theirs, "use_uncertainty": False})]
    out += [(f"real_{i}", case, theirs) for i, case in enumerate(real)]
    return out


def run_case(box_align, boxes_to_corners, case: dict, kwargs: dict) -> list:
    """The authors' refined poses (N, 3) ``[x, y, yaw deg]`` of one case."""
    corners = [boxes_to_corners(np.asarray(agent["boxes"], dtype=np.float64), order="lwh")
               if agent["boxes"] else np.zeros((0, 8, 3)) for agent in case["agents"]]
    log_vars = [np.asarray(agent["log_vars"], dtype=np.float64).reshape(-1, 3)
                for agent in case["agents"]]
    refined = box_align(corners, np.asarray(case["lidar_poses"], dtype=np.float64),
                        uncertainty_list=log_vars, **kwargs)
    return np.asarray(refined, dtype=np.float64).tolist()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, required=True, help="CoAlign sources checkout")
    parser.add_argument("--real", type=Path, default=None, help="real stage-1 cases (JSON)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    box_align, boxes_to_corners = import_box_align(args.source)
    real = json.loads(args.real.read_text()) if args.real else []
    fixture = {"reference": "yifanlu0227/CoAlign 64d1987 box_align_v2.py + g2o-python 0.0.12",
               "cases": []}
    for name, case, kwargs in cases_to_run(real):
        refined = run_case(box_align, boxes_to_corners, case, kwargs)
        fixture["cases"].append({"name": name, "args": kwargs, **case, "refined": refined})
        print(name, np.round(np.asarray(refined) - np.asarray(case["lidar_poses"])[:, [0, 1, 4]],
                             4).tolist())
    args.out.write_text(json.dumps(fixture))
    print(f"wrote {args.out} ({len(fixture['cases'])} cases)")


if __name__ == "__main__":
    main()
