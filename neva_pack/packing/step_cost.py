"""A model of one data-parallel rank's training step, in FLOPs, from the model's shape.

What a rank spends on one pack (a packed row: samples laid end to end under a block-diagonal
mask, each attending only within itself), summed over its samples::

    language model   m_lm  * ( 2 P_lm s                                  linear layers and LM head
                             + 4 d_lm (L_full s²/2 + L_win pairs(s, w)) )  causal attention
    projector        3     *   2 P_proj t                                  t: the sample's image positions
    vision encoder   m_vis * ( 2 P_vis p                                   p = t * patches_per_image_token
                             + 4 d_vis (L_full c + L_win min(c, w p)) )    c: Σ patches² per encoder pass

    pairs(s, w) = s²/2 (s <= w), w s - w²/2 (s > w): the query-key pairs of a causal sliding window

P: weights each position is multiplied by (forward: 2 FLOPs each); d: query heads x head dim (a
query-key pair costs 2d for QK^T and 2d for AV); L_full / L_win: layers attending over the whole
sample / within a window of w positions; c: the family's vision cost of the sample's images
(``ModelFamily.vision_cost_for_size``: patches² summed over its encoder passes). A trained tower
costs its forward and backward (m = 3); a frozen LM still passes gradients back to the projector
(m = 2); a frozen vision tower costs its forward only (m = 1).

What it leaves out: norms, rotary embeddings, softmax, the embedding lookups, communication and
kernel efficiency (every FLOP counts alike). It is a model of what differs between packs of the
same row length, which is what balancing needs: the step time's absolute value does not matter.

The presets are data: ``step_cost_presets.json`` beside this module, one per shipped model, each
with its source. ``step_cost_model(name)`` resolves a preset name, ``auto`` (the preset of the
run's encoder or family), ``attention`` (the unweighted cost of old: Σ s² + Σ patches²) or a JSON
file of the same shape. Pure: arrays in, arrays out; vectorised numpy (one pass, no hot loop).
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from neva_pack.packing.balance import DEFAULT_TOLERANCE, PackCosts, _per_pack, balance_order, straggler_overhead

__all__ = [
    "ATTENTION", "AUTO", "WORTH_IT", "StepCostModel", "StepOverheads", "Tower", "modelled_costs", "preset_names",
    "step_cost_model", "step_overheads",
]  # fmt: skip

AUTO = "auto"
"""``--step_cost_model auto``: the preset of the run's vision encoder, else of its family, else the default."""
ATTENTION = "attention"
"""``--step_cost_model attention``: the order of old, by Σ s² + Σ patches² unweighted (no model)."""
WORTH_IT = 0.01
"""Balancing is worth it when it saves at least this fraction of the modelled step time over a random order."""
PRESETS_FILE = "step_cost_presets.json"
_TOWER_KEYS = {"hidden_size", "layers", "heads", "kv_heads", "head_dim", "intermediate_size", "gated_mlp", "trained"}
_TOWER_OPTIONAL = {"vocab_size", "window_layers", "window", "window_head_dim"}
_MODEL_KEYS = {"lm", "vision", "patches_per_image_token", "projector_params"}
_MODEL_OPTIONAL = {"source", "encoders", "families"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Tower:
    """One transformer stack, as the cost model reads it (``Tower.of`` derives it from a config's shape)."""

    params: int
    """Weights each position is multiplied by in one forward pass: every layer's projections and MLP
    (an LM's head too)."""
    layers: int
    """Layers in all."""
    attention_width: int
    """Query heads x head dim of a layer attending over the whole sample."""
    window_layers: int = 0
    """Of ``layers``, those attending within a window (sliding, or windows of patches)."""
    window: int = 0
    """Positions of that window (0: none)."""
    window_attention_width: int = 0
    """Query heads x head dim of a window layer."""
    trained: bool
    """Its weights are trained (forward and backward: 3x the forward)."""

    @classmethod
    def of(cls, shape: dict, what: str) -> Tower:
        """From a config's shape (``step_cost_presets.json``'s keys); ValueError naming the key otherwise."""
        if not isinstance(shape, dict):
            raise ValueError(f"{what}: an object of {sorted(_TOWER_KEYS)} expected, got {type(shape).__name__}")
        unknown = set(shape) - _TOWER_KEYS - _TOWER_OPTIONAL
        missing = _TOWER_KEYS - set(shape)
        if unknown or missing:
            raise ValueError(f"{what}: " + (f"unknown key {min(unknown)!r}" if unknown else f"missing key {min(missing)!r}"))
        for key in sorted(set(shape) - {"gated_mlp", "trained"}):
            value = shape[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value > 2**40 or (value == 0 and key in _TOWER_KEYS):
                raise ValueError(f"{what}.{key} {value!r}: expected a positive integer")
        for key in ("gated_mlp", "trained"):
            if not isinstance(shape[key], bool):
                raise ValueError(f"{what}.{key} {shape[key]!r}: expected true or false")
        layers, window_layers = shape["layers"], shape.get("window_layers", 0)
        if window_layers > layers or bool(window_layers) != bool(shape.get("window", 0)):
            raise ValueError(f"{what}.window_layers {window_layers}: needs a window, and at most the {layers} layers")
        hidden, heads, kv_heads = shape["hidden_size"], shape["heads"], shape["kv_heads"]
        full_dim, window_dim = shape["head_dim"], shape.get("window_head_dim", shape["head_dim"])
        mlp = (3 if shape["gated_mlp"] else 2) * hidden * shape["intermediate_size"]

        def layer(head_dim: int) -> int:  # q and o: heads x head_dim wide; k and v: kv_heads x head_dim
            return 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + mlp

        params = (layers - window_layers) * layer(full_dim) + window_layers * layer(window_dim) + hidden * shape.get("vocab_size", 0)
        return cls(
            params=params, layers=layers, attention_width=heads * full_dim, window_layers=window_layers,
            window=shape.get("window", 0), window_attention_width=heads * window_dim if window_layers else 0,
            trained=shape["trained"],
        )  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class StepCostModel:
    """What one rank's step costs, per pack: the language model, the projector and the vision encoder."""

    name: str
    """The preset's name, or the JSON file it was read from."""
    lm: Tower
    """The language model (its head included in ``params``)."""
    vision: Tower | None
    """The vision encoder; None: a text-only model (images cost the LM's positions only)."""
    patches_per_image_token: int
    """Vision encoder positions per LM image position (merge², pixel shuffle, pooling)."""
    projector_params: int
    """Weights each LM image position is multiplied by in the projector (trained)."""

    @property
    def fingerprint(self) -> str:
        """The model in one short string: its name and a digest of every number (a sampler state's
        fingerprint holds it)."""
        numbers = json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()
        return f"{self.name}#{hashlib.sha256(numbers).hexdigest()[:16]}"

    def components(self, lengths, image_tokens=None, vision_cost=None) -> dict[str, np.ndarray]:
        """float64 modelled FLOPs of each sample's share of a step, by part (the module's formula):
        ``lm_linear``, ``lm_attention``, ``projector``, ``vision``; image tokens and vision cost per
        sample (None: none)."""
        s = np.asarray(lengths, dtype=np.float64)
        t = np.zeros_like(s) if image_tokens is None else np.asarray(image_tokens, dtype=np.float64)
        c = np.zeros_like(s) if vision_cost is None else np.asarray(vision_cost, dtype=np.float64)
        lm, vision = self.lm, self.vision
        pairs = lm.attention_width * (lm.layers - lm.window_layers) * s * s / 2
        if lm.window_layers:
            w = float(lm.window)
            pairs = pairs + lm.window_attention_width * lm.window_layers * np.where(s <= w, s * s / 2, w * s - w * w / 2)
        times = 3.0 if lm.trained else 2.0
        parts = {"lm_linear": times * 2.0 * lm.params * s, "lm_attention": times * 4.0 * pairs, "projector": 3.0 * 2.0 * self.projector_params * t}
        if vision is None:
            parts["vision"] = np.zeros_like(s)
            return parts
        patches = t * self.patches_per_image_token
        vision_pairs = vision.attention_width * (vision.layers - vision.window_layers) * c
        if vision.window_layers:
            vision_pairs = vision_pairs + vision.window_attention_width * vision.window_layers * np.minimum(c, vision.window * patches)
        parts["vision"] = (3.0 if vision.trained else 1.0) * (2.0 * vision.params * patches + 4.0 * vision_pairs)
        return parts

    def sample_flops(self, lengths, image_tokens=None, vision_cost=None) -> np.ndarray:
        """float64 modelled FLOPs of each sample's share of a step: the sum of its ``components``."""
        parts = self.components(lengths, image_tokens, vision_cost)
        return parts["lm_linear"] + parts["lm_attention"] + parts["projector"] + parts["vision"]

    def shares(self, lengths, image_tokens=None, vision_cost=None) -> dict[str, float]:
        """Fraction of these samples' modelled FLOPs each part takes (``components``, summed)."""
        sums = {name: float(values.sum()) for name, values in self.components(lengths, image_tokens, vision_cost).items()}
        total = sum(sums.values())
        return {name: value / total if total > 0 else 0.0 for name, value in sums.items()}


def model_of(entry, name: str) -> StepCostModel:
    """A model from one preset's object (``step_cost_presets.json``'s shape); ValueError naming the key."""
    if not isinstance(entry, dict):
        raise ValueError(f"step cost model {name}: an object expected, got {type(entry).__name__}")
    unknown, missing = set(entry) - _MODEL_KEYS - _MODEL_OPTIONAL, _MODEL_KEYS - set(entry)
    if unknown or missing:
        raise ValueError(f"step cost model {name}: " + (f"unknown key {min(unknown)!r}" if unknown else f"missing key {min(missing)!r}"))
    for key in ("patches_per_image_token", "projector_params"):
        value = entry[key]
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 2**40:
            raise ValueError(f"step cost model {name}: {key} {value!r}: expected a non-negative integer")
    return StepCostModel(
        name=name, lm=Tower.of(entry["lm"], f"step cost model {name}: lm"),
        vision=None if entry["vision"] is None else Tower.of(entry["vision"], f"step cost model {name}: vision"),
        patches_per_image_token=entry["patches_per_image_token"], projector_params=entry["projector_params"],
    )  # fmt: skip


def _presets() -> dict:
    return json.loads((importlib.resources.files("neva_pack.packing") / PRESETS_FILE).read_text())


def preset_names() -> list[str]:
    """The shipped presets (``--step_cost_model`` takes one, ``auto``, ``attention`` or a JSON file)."""
    return sorted(_presets()["presets"])


def step_cost_model(choice: str | None, encoder: str | None = None, family: str | None = None) -> StepCostModel | None:
    """The model ``choice`` names: a preset, ``auto`` (or None: the preset listing ``encoder`` -- a
    name, or a directory whose last component is one -- else ``family``, else the default), a JSON
    file of one preset's shape, or ``attention``: None (the unweighted order of old). ValueError,
    one line, for an unknown name or a bad file."""
    data = _presets()
    presets = data["presets"]
    if choice == ATTENTION:
        return None
    if choice is None or choice == AUTO:
        name = _auto(presets, encoder, family) or data["default"]
        return model_of(presets[name], name)
    if choice in presets:
        return model_of(presets[choice], choice)
    path = Path(choice)
    if path.suffix.lower() != ".json":
        raise ValueError(f"--step_cost_model {choice!r}: choose one of {', '.join([AUTO, ATTENTION, *sorted(presets)])}, or a .json file")
    if not path.is_file():
        raise ValueError(f"--step_cost_model {choice}: no such regular file")
    if path.stat().st_size > 1 << 20:
        raise ValueError(f"--step_cost_model {choice}: over 1 MiB, not a step cost model")
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise ValueError(f"--step_cost_model {choice}: not JSON ({error})") from None
    return model_of(entry, str(path))


def _auto(presets: dict, encoder: str | None, family: str | None) -> str | None:
    """The preset listing ``encoder`` (by its name's last component, case aside), else ``family``."""
    if encoder:
        last = str(encoder).rstrip("/").rsplit("/", 1)[-1].lower()
        for name, entry in sorted(presets.items()):
            if any(listed.rsplit("/", 1)[-1].lower() == last for listed in entry.get("encoders", ())):
                return name
    if family:
        for name, entry in sorted(presets.items()):
            if family in entry.get("families", ()):
                return name
    return None


def modelled_costs(model: StepCostModel, lengths, offsets, num_images, image_tokens=None, vision_cost=None) -> PackCosts:
    """``PackCosts.of`` the samples in pack order, with each pack's modelled step FLOPs (what
    ``balance_order`` then orders by)."""
    costs = PackCosts.of(lengths, offsets, num_images, vision_cost)
    modelled = _per_pack(model.sample_flops(lengths, image_tokens, vision_cost), np.asarray(offsets, dtype=np.int64))
    return PackCosts(attention=costs.attention, tokens=costs.tokens, images=costs.images, vision=costs.vision, modelled=modelled)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepOverheads:
    """Straggler overhead of the modelled step time (``straggler_overhead``) of three orders of the packs."""

    random: float
    """A random order (the mean of ``RANDOM_ORDERS`` seeded permutations)."""
    today: float
    """The order by Σ s² + Σ patches², unweighted (``balance_order`` without a model: the order of old)."""
    modelled: float
    """The order by the modelled step time (``balance_order`` of ``modelled_costs``, tolerance 0)."""

    @property
    def worth_it(self) -> bool:
        """Balancing saves at least ``WORTH_IT`` of the step time over a random order."""
        return self.random - self.modelled >= WORTH_IT


RANDOM_ORDERS = 5
"""Random permutations whose overheads ``step_overheads`` averages."""


def step_overheads(costs: PackCosts, group_size: int, seed: int = 0) -> tuple[StepOverheads, np.ndarray]:
    """The overheads of a random order, today's order and the modelled one (``costs`` from
    ``modelled_costs``), and the modelled order itself (seeded: the same for the same seed)."""
    if costs.modelled is None:
        raise ValueError("step_overheads needs modelled costs (modelled_costs)")
    count = len(costs.tokens)
    step = costs.modelled
    randoms = [straggler_overhead(step, group_size, np.random.default_rng((seed, 2, k)).permutation(count)) for k in range(RANDOM_ORDERS)]
    legacy = PackCosts(attention=costs.attention, tokens=costs.tokens, images=costs.images, vision=costs.vision)
    today = balance_order(legacy, group_size, np.random.default_rng((seed, 1)), DEFAULT_TOLERANCE)
    order = balance_order(costs, group_size, np.random.default_rng((seed, 1)), 0.0)
    overheads = StepOverheads(
        random=float(np.mean(randoms)) if count else 0.0,
        today=straggler_overhead(step, group_size, today),
        modelled=straggler_overhead(step, group_size, order),
    )
    return overheads, order
