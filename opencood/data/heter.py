"""Heterogeneous agents: HEAL's modality assignment and OPV2V-H's extra sensor files
(docs/DESIGN.md §4.4).

**Which modality an agent has** (:class:`ModalityPlan`, HEAL's ``heter_utils.Adaptor``). The
``heter.assignment_path`` json maps scenario -> cav id -> an assigned modality (``m1``..).
Evaluation: an agent's modality is ``mapping_dict[assigned]``; when the first agent's assigned
modality is not one of ``ego_modality``, the ego becomes the first agent of the json whose
mapped modality is (HEAL's ``reorder_cav_list``), the others keep folder order; agents whose
mapped modality is not in ``modality_setting`` take no part (HEAL's ``unmatched_modality``).
Training: the ego's modality is drawn from ``ego_modality``, every other agent's by
``cav_preference`` (HEAL's ``reassign_cav_modality``), from the sample's own generator (seed,
stream, epoch, index), so a draw never depends on workers or batch composition. Differences
from HEAL, on purpose: training keeps the folder's ego (HEAL shuffles the agents, so a random
one is the ego: none of our readers does that); the ego search skips roadside units (our ego is
a vehicle) and reads ``ego_modality`` as the '&'-separated names (HEAL tests the assigned name
as a substring of the string); unmatched agents leave before the range and ``max_cav``
selection, not after; an unmatched ego with no agent of ``ego_modality`` to replace it gives
way to the first agent the model has a modality for (HEAL drops the ego's input and fuses the
others in its frame), and a scenario without any such agent takes no part.

**Which files** (:func:`hetero_path`, :func:`lidar_file`, :func:`depth_files`): OPV2V-H's
32- and 16-beam LiDARs are ``<ts>_32.pcd`` / ``<ts>_16.pcd`` and its depth images
``<ts>_depth0..3.png``, at the path of the OPV2V file with ``OPV2V`` replaced by
``OPV2V_Hetero`` (HEAL's ``switch_lidar_channels`` and ``find_camera_files``): a folder whose
path does not say ``OPV2V`` holds them beside the 64-beam ``<ts>.pcd``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

from opencood.errors import OpencoodError

# The substitution HEAL makes in a path to reach OPV2V-H's files.
OPV2V_NAME, HETERO_NAME = "OPV2V", "OPV2V_Hetero"
FULL_BEAMS = 64            # OPV2V's own LiDAR: <ts>.pcd


class AssignmentError(OpencoodError, ValueError):
    """A missing or inconsistent modality assignment; the message names the file, the scenario
    and the agent."""


def hetero_path(path) -> Path:
    """HEAL's OPV2V-H location of a file of the OPV2V tree: every ``OPV2V`` in the path as
    given becomes ``OPV2V_Hetero``."""
    return Path(str(path).replace(OPV2V_NAME, HETERO_NAME))


def lidar_file(cav_dir, timestamp: str, channels: Optional[int]) -> Path:
    """The point cloud of one agent frame for a LiDAR of ``channels`` beams (None or 64: OPV2V's
    ``<ts>.pcd``; 32, 16: OPV2V-H's ``<ts>_32.pcd``, ``<ts>_16.pcd`` at :func:`hetero_path`)."""
    path = Path(cav_dir) / f"{timestamp}.pcd"
    if channels is None or channels == FULL_BEAMS:
        return path
    return Path(str(hetero_path(path)).replace(".pcd", f"_{channels}.pcd"))


def depth_files(cav_dir, timestamp: str, cameras: int) -> List[Path]:
    """OPV2V-H's depth images of one agent frame, camera by camera."""
    return [hetero_path(Path(cav_dir) / f"{timestamp}_depth{index}.png")
            for index in range(cameras)]


def read_assignment(path) -> Dict[str, Dict[str, str]]:
    """The json {scenario: {cav id: assigned modality}}; AssignmentError naming the file when
    it is missing, not json or not that shape."""
    path = Path(path)
    try:
        with open(path) as handle:
            data = json.load(handle)
    except FileNotFoundError:
        raise AssignmentError(f"{path}: modality assignment not found "
                              f"(heter.assignment_path)") from None
    except (OSError, ValueError) as exc:
        raise AssignmentError(f"{path}: unreadable modality assignment ({exc})") from None
    if not isinstance(data, dict) or not all(
            isinstance(agents, dict) and all(isinstance(m, str) for m in agents.values())
            for agents in data.values()):
        raise AssignmentError(f"{path}: expected {{scenario: {{cav id: modality name}}}}")
    return data


def in_order_modalities(cav_ids: Sequence[str], names: Sequence[str]) -> Dict[str, str]:
    """HEAL's in-order assignment of one scenario (``heter_utils.assign_modality_4_in_order``,
    its names ``m1``..``m4``): the agents in folder (string) order, a first folder ``-1`` (a
    roadside unit) moved last, take ``names`` in turn, cycling. -> {cav id: name}."""
    order = sorted(cav_ids)
    if order and order[0] == "-1":
        order = order[1:] + order[:1]
    return {cav_id: names[k % len(names)] for k, cav_id in enumerate(order)}


def in_order_assignment(split_dir, names: Sequence[str]) -> Dict[str, Dict[str, str]]:
    """:func:`in_order_modalities` of every scenario folder of ``split_dir`` (its agent
    folders), {scenario: {cav id: name}}: the assignment HEAL's ``inference_heter_in_order``
    reads (its ``_in_order.json``), for any split and modality names."""
    split_dir = Path(split_dir)
    return {scenario.name: in_order_modalities(
                [p.name for p in scenario.iterdir() if p.is_dir()], names)
            for scenario in sorted(p for p in split_dir.iterdir() if p.is_dir())}


class ModalityPlan:
    """Each agent's modality, from the resolved ``heter`` section (module doc).

    Args:
        heter: the resolved ``heter`` section (``opencood.config_schema.HeterSection``).
        train: draw the modalities (training) or map the assignment (evaluation).
        is_infrastructure: cav id -> whether it is a roadside unit (never made the ego).
    """

    def __init__(self, heter: dict, train: bool, is_infrastructure=lambda cav_id: False):
        self.heter = heter
        self.train = bool(train)
        self.is_infrastructure = is_infrastructure
        self.path = Path(heter["assignment_path"])
        self.assignment = read_assignment(self.path)
        self.settings = heter["modality_setting"]
        self.ego_modalities = tuple(heter["ego_modality"].split("&"))
        preference = heter["cav_preference"] or dict.fromkeys(self.settings, 1.0)
        weights = np.asarray(list(preference.values()), dtype=np.float64)
        self._preferred = list(preference)
        self._weights = weights / weights.sum()

    # -- what a modality reads ----------------------------------------------------------------
    def sensor_type(self, modality: str) -> str:
        return self.settings[modality]["sensor_type"]

    def channels(self, modality: str) -> Optional[int]:
        """The beams of a LiDAR modality's sensor (None: OPV2V's 64-beam one)."""
        return (self.heter["lidar_channels_dict"] or {}).get(modality)

    # -- which agents, in which order ---------------------------------------------------------
    def assigned(self, scenario: str, cav_ids: Sequence[str]) -> Dict[str, str]:
        """The scenario's {cav id: assigned modality}, checked against its agent folders."""
        where = f"{self.path}: scenario {scenario}"
        agents = self.assignment.get(scenario)
        if agents is None:
            raise AssignmentError(f"{where} is not assigned (heter.assignment_path lists "
                                  f"{len(self.assignment)} other scenarios)")
        for cav_id in cav_ids:
            if cav_id not in agents:
                raise AssignmentError(f"{where}, agent {cav_id}: no modality assigned")
        for cav_id, modality in agents.items():
            if cav_id not in cav_ids:
                raise AssignmentError(f"{where}, agent {cav_id}: assigned {modality!r} but the "
                                      f"scenario has no such agent folder")
            if modality not in self.heter["mapping_dict"]:
                raise AssignmentError(f"{where}, agent {cav_id}: assigned {modality!r}, which "
                                      f"heter.mapping_dict does not map")
        return agents

    def mapped(self, scenario: str, cav_id: str) -> str:
        """Evaluation: the model's modality of one agent (``mapping_dict`` of its assigned)."""
        return self.heter["mapping_dict"][self.assignment[scenario][cav_id]]

    def agent_order(self, scenario: str, cav_ids: List[str]) -> List[str]:
        """The split's hook (``OPV2VSplit(agent_order=...)``): ``cav_ids`` in folder order (ego
        first) -> the agents taking part, ego first ([]: none, the scenario is left out).
        Checks the scenario's assignment."""
        agents = self.assigned(scenario, cav_ids)
        if self.train:
            return list(cav_ids)
        order = list(cav_ids)
        if agents[order[0]] not in self.ego_modalities:
            ego = next((cav_id for cav_id in agents if not self.is_infrastructure(cav_id)
                        and self.mapped(scenario, cav_id) in self.ego_modalities), None)
            if ego is not None:
                order = [ego] + [cav_id for cav_id in order if cav_id != ego]
        kept = [cav_id for cav_id in order if self.mapped(scenario, cav_id) in self.settings]
        # An ego the model has no modality for (nobody of ego_modality replaced it) left with
        # the unmatched: the first vehicle kept is the ego (HEAL drops the ego's input but keeps
        # its frame); no vehicle kept: the scenario takes no part (HEAL's empty samples).
        vehicles = [cav_id for cav_id in kept if not self.is_infrastructure(cav_id)]
        if not vehicles:
            return []
        return vehicles[:1] + [cav_id for cav_id in kept if cav_id != vehicles[0]]

    def modalities(self, scenario: str, cav_ids: Sequence[str],
                   rng: Optional[np.random.Generator]) -> List[str]:
        """The model's modality of each agent of a sample (ego first). Training draws them
        from ``rng``: the ego's first, then agent after agent."""
        if not self.train:
            return [self.mapped(scenario, cav_id) for cav_id in cav_ids]
        ego = self.ego_modalities[int(rng.integers(len(self.ego_modalities)))]
        others = rng.choice(len(self._preferred), size=len(cav_ids) - 1, p=self._weights)
        return [ego] + [self._preferred[int(k)] for k in others]
