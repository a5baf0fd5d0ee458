"""Our FQNs <-> Hugging Face's parameter names for a decoder (torch-free): the table every family's HF adapter maps
names with. The top of the model is named alike in every HF decoder; a family gives its block names."""

from __future__ import annotations

import re

# our FQN (below "model.") -> HF's, outside the blocks: the same in Llama, Qwen3 and DeepSeek-V3 checkpoints
TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# buffers some HF checkpoints carry; derived from the config, never weights
HF_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_LAYER = re.compile(r"^(model\.)?layers\.(\d+)\.(.+)$")


def layer_template(name: str) -> tuple[str, int | None]:
    """`layers.3.x` (or HF's `model.layers.3.x`) -> (`layers.{}.x`, 3); other names -> (name, None)."""
    m = _LAYER.match(name)
    if m is None:
        return name, None
    return f"{m.group(1) or ''}layers.{{}}.{m.group(3)}", int(m.group(2))


class HFNames:
    """One family's name table: its block names (ours below `layers.N.` -> HF's below `model.layers.N.`) plus
    `TOP_NAMES`, both ways."""

    def __init__(self, family: str, layer_names: dict[str, str]) -> None:
        self.family = family
        layers = {f"layers.{{}}.{ours}": f"model.layers.{{}}.{hf}" for ours, hf in layer_names.items()}
        self._to_hf = {**TOP_NAMES, **layers}
        self._from_hf = {hf: ours for ours, hf in self._to_hf.items()}

    def to_hf(self, fqn: str) -> str:
        """Our FQN (`layers.0.attention.wq.weight`) -> HF's (`model.layers.0.self_attn.q_proj.weight`)."""
        return self._mapped(fqn, self._to_hf, "meshtrain")

    def from_hf(self, name: str) -> str:
        """HF's parameter name -> our FQN (KeyError naming the expected names for anything else)."""
        return self._mapped(name, self._from_hf, "Hugging Face")

    def _mapped(self, name: str, table: dict[str, str], side: str) -> str:
        template, layer = layer_template(name)
        if template not in table:
            raise KeyError(f"{name!r} is not a {self.family} {side} parameter name (expected one of {sorted(table)})")
        return table[template].format(layer) if layer is not None else table[template]
