"""OpenCOOD state dicts <-> ours, per model, strictly (issue 24).

OpenCOOD's ``train.py`` saves bare state dicts (no ``module.`` prefix) and reloads them with
``strict=False``, so a mismatch passes silently there. Here a translation either places every
tensor or fails: every source tensor must match exactly one rule, land on a key of the target
model and fit its shape, and every target tensor must be filled (by a rule, or by the one
documented synthesis below); otherwise :class:`InteropError` names, on one line, the first keys it
could not place.

The rules follow the two codebases' module structure (read from opencoodx 0.1.19):

OpenCOOD key                                      our key                             transform
pillar_vfe.pfn_layers.{i}.{linear,norm}.*         encoder.vfe.layers.{i}.{linear,norm}.*  copy
backbone.blocks.{i}.{j}.*  (j = 0: ZeroPad2d)     backbone.blocks.{i}.{j-1}.*         copy (1)
backbone.deblocks.{i}.{j}.*                       backbone.deblocks.{i}.{j}.*         copy
cls_head.*, reg_head.*                            head.cls_conv.*, head.reg_conv.*    copy (2)
shrink_conv.layers.0.double_conv.{0,2}.*          shrink.layers.{0,2}.*               centre (3)
fusion_net.msg_cnn.weight (V2VNet)                fusion.message_cnn.weight           swap (4)
fusion_net.msg_cnn.bias                           fusion.message_cnn.bias             copy
fusion_net.conv_gru.cell_list.0.conv_gates.*      fusion.gru.gates.*                  copy
fusion_net.conv_gru.cell_list.0.conv_can.*        fusion.gru.candidate.*              copy
fusion_net.mlp.{weight,bias} (Linear C x C)       fusion.output.* (1x1 conv)          reshape
V2X-ViT (v2x-vit's point_pillar_transformer), E = fusion_net.encoder, L = E.layers.{d}:
E.rte.emb.emb.weight                              fusion.delay_encoding.table         copy (5)
E.rte.emb.lin.*                                   fusion.delay_encoding.linear.*      copy
E.prior_feed.*                                    fusion.prior_feed.*                 copy (6)
L.0.layers.{b}.0.norm.*                           fusion.blocks.{d}.{b}.agent_norm.*  copy
L.0.layers.{b}.0.fn.{q,k,v,a}_linears.{t}.*       ...agent_attention.to_{q,k,v,out}.{t}.*
L.0.layers.{b}.0.fn.relation_att                  ...agent_attention.relation_att     copy
L.0.layers.{b}.0.fn.relation_msg                  ...agent_attention.relation_msg     transpose (7)
L.0.layers.{b}.1.norm.*                           fusion.blocks.{d}.{b}.window_norm.*
L.0.layers.{b}.1.fn.pwmsa.{s}.{to_qkv,to_out.0}.* ...window_attention.scales.{s}.(same)
L.0.layers.{b}.1.fn.pwmsa.{s}.pos_embedding       ...window_attention.scales.{s}.position_bias
L.0.layers.{b}.1.fn.split_attn.{fc1,bn1,fc2}.*    ...split.{squeeze.0,squeeze.1,excite}.*
L.1.norm.*, L.1.fn.net.{j}.*                      fusion.feed_forwards.{d}.0.*, .1.{j}.*
fusion_net.naive_communication.gaussian_filter.*  fusion.smooth.*                     copy (5)
fusion_net.pixel_weight_layer.conv1_1.weight      fusion.edge_net.layers.0.weight     swap (6)
fusion_net.pixel_weight_layer.{conv,bn}1_{k}.*    fusion.edge_net.layers.{3k-3,3k-2}.* copy (6)
dir_head.*                                        head.dir_conv.*                     copy (6)
fusion_net.layers.{i}.{window,grid}_attention.    fusion.blocks.{i}.{window,grid}_    copy (7)
  norm.* / fn.to_qkv.* / fn.to_out.0.* /            norm.* / attention.to_qkv.* /
  fn.relative_position_bias_table.* /               attention.to_out.0.* /
  fn.relative_position_index                        attention.bias_table.* / .slot_index
fusion_net.layers.{i}.{window,grid}_ffd.          fusion.blocks.{i}.{window,grid}_    copy
  norm.* / fn.net.{j}.*                             ffn.0.* / ffn.1.{j}.*
fusion_net.mlp_head.{2,3}.*                       fusion.head_norm.*, fusion.head.*   copy
backbone.resnet.layer{i}.{k}.                     backbone.blocks.{i}.{k}.            copy (8)
  conv1 / bn1 / conv2 / bn2 / downsample.{0,1}      residual.{0,1,3,4} / shortcut.{0,1}

1. OpenCOOD pads with a ``ZeroPad2d(1)`` before each scale's strided conv (padding 0); ours
   pads inside the conv (padding 1): the same map, one Sequential index earlier.
2. Same channel layout: channel ``a * 7 + k`` is box code k of anchor a (anchors (H, W, A)).
   OpenCOOD has no direction head: the translated config builds ours without one
   (``model.args.use_dir: false``), so there is nothing to fill or drop.
3. F-Cooper's shrink starts with a 1x1 conv (stride 1, padding 0): the translated config
   builds ours with one too (``shrink_header.kernel_size: 1``), copied as it is. Into a 3x3
   conv with padding 1 the 1x1 kernel would go to the centre tap of zeros (exactly the same
   map); the other way the centre comes back, refused when the other taps are not zero.
4. OpenCOOD's message CNN reads [sender warped, receiver]; ours [receiver, sender]: the two
   halves of the input channels trade places (its own inverse).
5. The authors' delay table is an ``nn.Embedding`` that trains; the translated config sets
   ``delay_table: learned`` so ours holds it as a parameter.
6. Never used in their forward; ``prior_feed: true`` keeps a slot for it (round trip).
7. Their messages are ``W^T v`` (einsum over W's first index), ours ``W v``.

5. Where2comm (OpenCOOD's GitHub sources): its only fusion parameters are the Gaussian
   smoothing conv's; the confidence is its cls head on each agent's own map.
6. DiscoNet (CoAlign's ``point_pillar_disconet``): its edge network scores [sender warped,
   ego]; ours [ego, sender]: the halves of the first conv's input channels trade places.
   CoAlign's heads have a direction classifier (``dir_args``), as ours.
7. CoBEVT (OpenCOOD's GitHub ``point_pillar_cobevt``, ``fax_fusion.mask: true``): the same
   layers; its 3-D bias table and its index buffer need ours with ``agent_bias: slot_offset``
   (the same table size and index; ours keeps the index persistent too).
8. CoAlign's fusion network (its yamls' ``point_pillar_baseline_multiscale``; its
   ``point_pillar_coalign.py`` subclasses it unchanged): the ResNet backbone of HEAL / CoAlign,
   our ``base_bev_backbone.resnet: true`` (torchvision BatchNorm defaults inside the blocks,
   a 1x1 strided conv + BN shortcut where the shape changes), its parameter-free AttFusion per
   scale, the 3x3 shrink header and the direction head.

The ConvGRU and the attention have the same parameters in both; whether the FORWARD passes agree
is what ``tests/test_parity_opencood.py`` checks against the authors' code.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Mapping, Optional, Tuple

import torch

from opencood.errors import OpencoodError

SHOWN_KEYS = 3


class InteropError(OpencoodError, ValueError):
    """A foreign config or checkpoint that cannot be translated; one line naming file and key."""


# ----------------------------------------------------------------------------------------------
# Tensor transforms: to_ours(tensor, our_shape) and to_peer(tensor, peer_shape); each returns
# the tensor in the destination's layout, or raises InteropError with the reason.
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Transform:
    name: str
    to_ours: Callable[[torch.Tensor, Tuple[int, ...]], torch.Tensor]
    to_peer: Callable[[torch.Tensor, Tuple[int, ...]], torch.Tensor]


def _copy(tensor: torch.Tensor, shape) -> torch.Tensor:
    return tensor


def _swap_input_halves(tensor: torch.Tensor, shape) -> torch.Tensor:
    if tensor.dim() < 2 or tensor.shape[1] % 2:
        return tensor          # the shape check reports it
    first, second = tensor.chunk(2, dim=1)
    return torch.cat([second, first], dim=1)


def _linear_as_conv(tensor: torch.Tensor, shape) -> torch.Tensor:
    return tensor.reshape(*tensor.shape, 1, 1) if tensor.dim() == 2 else tensor


def _conv_as_linear(tensor: torch.Tensor, shape) -> torch.Tensor:
    return tensor.reshape(tensor.shape[:2]) if tensor.dim() == 4 and \
        tensor.shape[2:] == (1, 1) else tensor


def _kernel_into_centre(tensor: torch.Tensor, shape) -> torch.Tensor:
    """A 1x1 conv kernel as the centre tap of a k x k kernel of zeros (k odd)."""
    shape = tuple(shape)
    if tensor.dim() != 4 or tuple(tensor.shape[2:]) != (1, 1) or len(shape) != 4 or \
            tuple(tensor.shape) == shape or shape[2] % 2 == 0 or shape[2] != shape[3]:
        return tensor
    kernel = tensor.new_zeros(*tensor.shape[:2], *shape[2:])
    kernel[:, :, shape[2] // 2, shape[3] // 2] = tensor[:, :, 0, 0]
    return kernel


def _kernel_from_centre(tensor: torch.Tensor, shape) -> torch.Tensor:
    shape = tuple(shape)
    if tensor.dim() != 4 or len(shape) != 4 or shape[2:] != (1, 1) or \
            tuple(tensor.shape[2:]) == (1, 1) or tensor.shape[2] % 2 == 0:
        return tensor
    centre = tensor[:, :, tensor.shape[2] // 2, tensor.shape[3] // 2]
    rest = tensor.clone()
    rest[:, :, tensor.shape[2] // 2, tensor.shape[3] // 2] = 0
    if rest.abs().max() > 0:
        raise InteropError("its k x k kernel has non-zero taps off the centre, which a 1x1 "
                           "conv cannot hold")
    return centre[:, :, None, None].clone()


COPY = Transform("copy", _copy, _copy)
SWAP_INPUT_HALVES = Transform("swap input halves", _swap_input_halves, _swap_input_halves)
LINEAR_AS_CONV = Transform("linear as 1x1 conv", _linear_as_conv, _conv_as_linear)
KERNEL_CENTRE = Transform("1x1 kernel at the centre", _kernel_into_centre, _kernel_from_centre)
TRANSPOSE = Transform("transpose the last two dims", lambda t, shape: t.transpose(-1, -2),
                      lambda t, shape: t.transpose(-1, -2))


# ----------------------------------------------------------------------------------------------
# Rules
# ----------------------------------------------------------------------------------------------

_PLACEHOLDER = re.compile(r"\{(\w+)\}")


@functools.lru_cache(maxsize=None)
def _template_regex(template: str) -> re.Pattern:
    """``a.{i}.{p}`` -> ``a\\.(?P<i>\\d+)\\.(?P<p>[A-Za-z_]+)``: ``p`` names a parameter or
    buffer (weight, running_var, ...), every other placeholder an index."""
    parts, last = [], 0
    for match in _PLACEHOLDER.finditer(template):
        parts.append(re.escape(template[last:match.start()]))
        name = match.group(1)
        parts.append(f"(?P<{name}>[A-Za-z_]+)" if name == "p" else f"(?P<{name}>\\d+)")
        last = match.end()
    parts.append(re.escape(template[last:]))
    return re.compile("".join(parts))


@dataclass(frozen=True)
class Rule:
    """OpenCOOD key template <-> our key template; ``shift``: our index = peer index + shift."""

    peer: str
    ours: str
    transform: Transform = COPY
    shift: Mapping[str, int] = field(default_factory=dict)

    def peer_to_ours(self, key: str) -> Optional[str]:
        return self._rename(key, self.peer, self.ours, 1)

    def ours_to_peer(self, key: str) -> Optional[str]:
        return self._rename(key, self.ours, self.peer, -1)

    def _rename(self, key: str, source: str, target: str, sign: int) -> Optional[str]:
        match = _template_regex(source).fullmatch(key)
        if match is None:
            return None
        values = dict(match.groupdict())
        for name, offset in self.shift.items():
            values[name] = str(int(values[name]) + sign * offset)
        return target.format(**values)


PILLAR_RULES = (
    Rule("pillar_vfe.pfn_layers.{i}.linear.{p}", "encoder.vfe.layers.{i}.linear.{p}"),
    Rule("pillar_vfe.pfn_layers.{i}.norm.{p}", "encoder.vfe.layers.{i}.norm.{p}"),
    Rule("backbone.blocks.{i}.{j}.{p}", "backbone.blocks.{i}.{j}.{p}", shift={"j": -1}),
    Rule("backbone.deblocks.{i}.{j}.{p}", "backbone.deblocks.{i}.{j}.{p}"),
    Rule("cls_head.{p}", "head.cls_conv.{p}"),
    Rule("reg_head.{p}", "head.reg_conv.{p}"),
)
SHRINK_RULES = (
    Rule("shrink_conv.layers.0.double_conv.0.{p}", "shrink.layers.0.{p}", KERNEL_CENTRE),
    Rule("shrink_conv.layers.0.double_conv.2.{p}", "shrink.layers.2.{p}"),
)
V2VNET_RULES = (
    Rule("fusion_net.msg_cnn.weight", "fusion.message_cnn.weight", SWAP_INPUT_HALVES),
    Rule("fusion_net.msg_cnn.bias", "fusion.message_cnn.bias"),
    Rule("fusion_net.conv_gru.cell_list.0.conv_gates.{p}", "fusion.gru.gates.{p}"),
    Rule("fusion_net.conv_gru.cell_list.0.conv_can.{p}", "fusion.gru.candidate.{p}"),
    Rule("fusion_net.mlp.weight", "fusion.output.weight", LINEAR_AS_CONV),
    Rule("fusion_net.mlp.bias", "fusion.output.bias"),
)
_V2XVIT_ENCODER = "fusion_net.encoder"
_V2XVIT_BLOCK = _V2XVIT_ENCODER + ".layers.{d}.0.layers.{b}"
_OUR_BLOCK = "fusion.blocks.{d}.{b}"
V2XVIT_RULES = (
    Rule(f"{_V2XVIT_ENCODER}.rte.emb.emb.weight", "fusion.delay_encoding.table"),
    Rule(f"{_V2XVIT_ENCODER}.rte.emb.lin.{{p}}", "fusion.delay_encoding.linear.{p}"),
    Rule(f"{_V2XVIT_ENCODER}.prior_feed.{{p}}", "fusion.prior_feed.{p}"),
    Rule(f"{_V2XVIT_BLOCK}.0.norm.{{p}}", f"{_OUR_BLOCK}.agent_norm.{{p}}"),
    *(Rule(f"{_V2XVIT_BLOCK}.0.fn.{theirs}_linears.{{t}}.{{p}}",
           f"{_OUR_BLOCK}.agent_attention.to_{ours}.{{t}}.{{p}}")
      for theirs, ours in (("q", "q"), ("k", "k"), ("v", "v"), ("a", "out"))),
    Rule(f"{_V2XVIT_BLOCK}.0.fn.relation_att", f"{_OUR_BLOCK}.agent_attention.relation_att"),
    Rule(f"{_V2XVIT_BLOCK}.0.fn.relation_msg", f"{_OUR_BLOCK}.agent_attention.relation_msg",
         TRANSPOSE),
    Rule(f"{_V2XVIT_BLOCK}.1.norm.{{p}}", f"{_OUR_BLOCK}.window_norm.{{p}}"),
    Rule(f"{_V2XVIT_BLOCK}.1.fn.pwmsa.{{s}}.to_qkv.{{p}}",
         f"{_OUR_BLOCK}.window_attention.scales.{{s}}.to_qkv.{{p}}"),
    Rule(f"{_V2XVIT_BLOCK}.1.fn.pwmsa.{{s}}.to_out.0.{{p}}",
         f"{_OUR_BLOCK}.window_attention.scales.{{s}}.to_out.0.{{p}}"),
    Rule(f"{_V2XVIT_BLOCK}.1.fn.pwmsa.{{s}}.pos_embedding",
         f"{_OUR_BLOCK}.window_attention.scales.{{s}}.position_bias"),
    *(Rule(f"{_V2XVIT_BLOCK}.1.fn.split_attn.{theirs}.{{p}}",
           f"{_OUR_BLOCK}.window_attention.split.{ours}.{{p}}")
      for theirs, ours in (("fc1", "squeeze.0"), ("bn1", "squeeze.1"), ("fc2", "excite"))),
    Rule(f"{_V2XVIT_ENCODER}.layers.{{d}}.1.norm.{{p}}", "fusion.feed_forwards.{d}.0.{p}"),
    Rule(f"{_V2XVIT_ENCODER}.layers.{{d}}.1.fn.net.{{j}}.{{p}}",
         "fusion.feed_forwards.{d}.1.{j}.{p}"),
)
WHERE2COMM_RULES = (
    Rule("fusion_net.naive_communication.gaussian_filter.{p}", "fusion.smooth.{p}"),
)
DISCONET_RULES = (
    Rule("fusion_net.pixel_weight_layer.conv1_1.weight", "fusion.edge_net.layers.0.weight",
         SWAP_INPUT_HALVES),
    Rule("fusion_net.pixel_weight_layer.conv1_1.bias", "fusion.edge_net.layers.0.bias"),
    Rule("fusion_net.pixel_weight_layer.bn1_1.{p}", "fusion.edge_net.layers.1.{p}"),
    Rule("fusion_net.pixel_weight_layer.conv1_2.{p}", "fusion.edge_net.layers.3.{p}"),
    Rule("fusion_net.pixel_weight_layer.bn1_2.{p}", "fusion.edge_net.layers.4.{p}"),
    Rule("fusion_net.pixel_weight_layer.conv1_3.{p}", "fusion.edge_net.layers.6.{p}"),
    Rule("fusion_net.pixel_weight_layer.bn1_3.{p}", "fusion.edge_net.layers.7.{p}"),
    Rule("fusion_net.pixel_weight_layer.conv1_4.{p}", "fusion.edge_net.layers.9.{p}"),
    Rule("dir_head.{p}", "head.dir_conv.{p}"),
)

_RESNET_BLOCK = "backbone.resnet.layer{i}.{k}"
_OUR_RESNET_BLOCK = "backbone.blocks.{i}.{k}"
# HEAL's / CoAlign's ResNetBEVBackbone (torchvision-style BasicBlocks) -> ours (backbone.py)
RESNET_BACKBONE_RULES = tuple(
    Rule(f"{_RESNET_BLOCK}.{theirs}.{{p}}", f"{_OUR_RESNET_BLOCK}.{ours}.{{p}}")
    for theirs, ours in (("conv1", "residual.0"), ("bn1", "residual.1"), ("conv2", "residual.3"),
                         ("bn2", "residual.4"), ("downsample.0", "shortcut.0"),
                         ("downsample.1", "shortcut.1")))


def _cobevt_rules() -> Tuple[Rule, ...]:
    rules = []
    for kind in ("window", "grid"):
        peer, ours = f"fusion_net.layers.{{i}}.{kind}_", f"fusion.blocks.{{i}}.{kind}_"
        rules += [
            Rule(peer + "attention.norm.{p}", ours + "norm.{p}"),
            Rule(peer + "attention.fn.to_qkv.{p}", ours + "attention.to_qkv.{p}"),
            Rule(peer + "attention.fn.to_out.0.{p}", ours + "attention.to_out.0.{p}"),
            Rule(peer + "attention.fn.relative_position_bias_table.{p}",
                 ours + "attention.bias_table.{p}"),
            Rule(peer + "attention.fn.relative_position_index", ours + "attention.slot_index"),
            Rule(peer + "ffd.norm.{p}", ours + "ffn.0.{p}"),
            Rule(peer + "ffd.fn.net.{j}.{p}", ours + "ffn.1.{j}.{p}"),
        ]
    rules += [Rule("fusion_net.mlp_head.2.{p}", "fusion.head_norm.{p}"),
              Rule("fusion_net.mlp_head.3.{p}", "fusion.head.{p}")]
    return tuple(rules)


COBEVT_RULES = _cobevt_rules()

# OpenCOOD model.core_method -> the rules of its state dict.
# (point_pillar's shrink rules serve V2V4Real's single-agent model, which has a shrink_conv;
# OpenCOOD's has none, and a rule only applies to keys that exist on both sides.)
RULES: Dict[str, Tuple[Rule, ...]] = {
    "point_pillar": PILLAR_RULES + SHRINK_RULES,
    "point_pillar_intermediate": PILLAR_RULES,
    "point_pillar_fcooper": PILLAR_RULES + SHRINK_RULES,
    "point_pillar_v2vnet": PILLAR_RULES + SHRINK_RULES + V2VNET_RULES,
    "point_pillar_transformer": PILLAR_RULES + SHRINK_RULES + V2XVIT_RULES,   # v2x-vit
    "point_pillar_where2comm": PILLAR_RULES + SHRINK_RULES + WHERE2COMM_RULES,
    "point_pillar_cobevt": PILLAR_RULES + SHRINK_RULES + COBEVT_RULES,
    # CoAlign's (yifanlu0227/CoAlign): key rules only, its yaml is not translated
    "point_pillar_disconet": PILLAR_RULES + SHRINK_RULES + DISCONET_RULES,
    # CoAlign's fusion network (its AttFusion per scale has no parameters)
    "point_pillar_baseline_multiscale": PILLAR_RULES + RESNET_BACKBONE_RULES + SHRINK_RULES
    + (Rule("dir_head.{p}", "head.dir_conv.{p}"),),
}


def supported_models() -> Tuple[str, ...]:
    return tuple(RULES)


# ----------------------------------------------------------------------------------------------
# Translation
# ----------------------------------------------------------------------------------------------

def _listing(keys: Iterable[str]) -> str:
    keys = list(keys)
    shown = ", ".join(keys[:SHOWN_KEYS])
    return shown + (f" (+{len(keys) - SHOWN_KEYS} more)" if len(keys) > SHOWN_KEYS else "")


def rules_for(core_method: str, source: str) -> Tuple[Rule, ...]:
    if core_method not in RULES:
        raise InteropError(f"{source}: OpenCOOD model {core_method!r} has no counterpart here "
                           f"(supported: {', '.join(RULES)})")
    return RULES[core_method]


def strip_ddp_prefix(state: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Keys saved from a DDP-wrapped model all start with ``module.``: drop it (only then)."""
    if state and all(key.startswith("module.") for key in state):
        return {key[len("module."):]: value for key, value in state.items()}
    return dict(state)


def _translate(state: Mapping[str, torch.Tensor], rules, forward: bool,
               target_shapes: Mapping[str, Tuple[int, ...]], source: str,
               what: str) -> Dict[str, torch.Tensor]:
    """The strict core of both directions."""
    result: Dict[str, torch.Tensor] = {}
    origin: Dict[str, str] = {}
    unplaced = []
    for key, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise InteropError(f"{source}: entry {key!r} is a {type(tensor).__name__}, not a "
                               "tensor: not a state dict")
        placed = None
        for rule in rules:
            target = rule.peer_to_ours(key) if forward else rule.ours_to_peer(key)
            if target is not None and target in target_shapes:
                placed = rule, target
                break
        if placed is None:
            unplaced.append(key)
            continue
        rule, target = placed
        if target in result:
            raise InteropError(f"{source}: {key} and {origin[target]} both map to {target}")
        shape = tuple(target_shapes[target])
        convert = rule.transform.to_ours if forward else rule.transform.to_peer
        try:
            converted = convert(tensor, shape)
        except InteropError as error:
            raise InteropError(f"{source}: {key}: {error}") from None
        if tuple(converted.shape) != shape:
            raise InteropError(f"{source}: {key} {tuple(tensor.shape)} does not fit {target} "
                               f"{shape} of {what} (another width or config?)")
        result[target] = converted.contiguous()
        origin[target] = key
    unfilled = [key for key in target_shapes if key not in result]
    if unplaced or unfilled:
        problems = []
        if unplaced:
            problems.append(f"{len(unplaced)} of its tensors have no place in {what}: "
                            f"{_listing(unplaced)}")
        if unfilled:
            problems.append(f"{len(unfilled)} tensors of {what} are left unfilled: "
                            f"{_listing(unfilled)}")
        raise InteropError(f"{source}: not a strict match: {'; '.join(problems)}")
    return {key: result[key] for key in target_shapes}


def peer_state_to_ours(state: Mapping[str, torch.Tensor], rules: Tuple[Rule, ...],
                       our_shapes: Mapping[str, Tuple[int, ...]], source: str,
                       what: str) -> Dict[str, torch.Tensor]:
    """Any peer codebase's state dict -> ours by ``rules`` (HEAL's, V2V4Real's), strictly;
    ``what`` names our model in the errors."""
    return _translate(strip_ddp_prefix(state), rules, True, our_shapes, source, what)


def peer_shapes_by_rules(our_shapes: dict, rules) -> Dict[str, Tuple[int, ...]]:
    """The peer's key -> shape for every tensor a rule places (the camera rules copy)."""
    shapes = {}
    for key, shape in our_shapes.items():
        for rule in rules:
            peer_key = rule.ours_to_peer(key)
            if peer_key is not None:
                shapes[peer_key] = tuple(shape)
                break
    return shapes


def ours_to_peer_state(state: Mapping[str, torch.Tensor], rules: Tuple[Rule, ...],
                       peer_shapes: Mapping[str, Tuple[int, ...]], source: str,
                       what: str) -> Dict[str, torch.Tensor]:
    """The inverse of :func:`peer_state_to_ours`: our state dict -> the peer's keys and shapes
    ``peer_shapes``, strictly; ``what`` names the peer's model in the errors."""
    return _translate(strip_ddp_prefix(state), rules, False, peer_shapes, source, what)


def opencood_to_ours(state: Mapping[str, torch.Tensor], core_method: str,
                     our_shapes: Mapping[str, Tuple[int, ...]],
                     source: str = "checkpoint") -> Dict[str, torch.Tensor]:
    """OpenCOOD state dict of ``core_method`` -> ours, keyed and shaped as ``our_shapes`` (the
    state-dict shapes of the model built from the translated config). Strict (module doc)."""
    rules = rules_for(core_method, source)
    return _translate(strip_ddp_prefix(state), rules, True, our_shapes, source,
                      f"our model (for OpenCOOD's {core_method})")


def ours_to_opencood(state: Mapping[str, torch.Tensor], core_method: str,
                     peer_shapes: Mapping[str, Tuple[int, ...]],
                     source: str = "checkpoint") -> Dict[str, torch.Tensor]:
    """Our state dict -> OpenCOOD's ``core_method`` state dict with the keys and shapes of
    ``peer_shapes``. Strict."""
    rules = rules_for(core_method, source)
    return _translate(strip_ddp_prefix(state), rules, False, peer_shapes, source,
                      f"OpenCOOD's {core_method}")


def state_shapes(state: Mapping[str, torch.Tensor]) -> Dict[str, Tuple[int, ...]]:
    return {key: tuple(value.shape) for key, value in state.items()}
