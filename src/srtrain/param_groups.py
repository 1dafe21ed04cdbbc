"""The layer groups of a LLaMA / GPT-NeoX parameter, by its fully qualified name.

Stall counts, shadow errors and update sizes are reported per group, in the order of
:data:`GROUPS`. This module holds names only, so the optimizer, the metrics and the models
share one definition without importing one another.
"""

from __future__ import annotations

GROUPS = ("attention", "mlp", "embeddings", "norms", "head")

# Name components that identify each group in both families.
_HEAD_PARTS = frozenset({"lm_head", "embed_out"})
_EMBEDDING_PARTS = frozenset({"embed_tokens", "embed_in"})
_ATTENTION_PARTS = frozenset({"self_attn", "attention"})
_MLP_PARTS = frozenset({"mlp"})


def param_group_of(name: str) -> str:
    """The group (one of :data:`GROUPS`) of a parameter FQN; ValueError for an unknown name."""
    parts = name.split(".")
    if _HEAD_PARTS.intersection(parts):
        return "head"
    if _EMBEDDING_PARTS.intersection(parts):
        return "embeddings"
    if any("norm" in part for part in parts):
        return "norms"
    if _ATTENTION_PARTS.intersection(parts):
        return "attention"
    if _MLP_PARTS.intersection(parts):
        return "mlp"
    raise ValueError(
        f"parameter {name!r} is not a known LLaMA/GPT-NeoX parameter; groups: {GROUPS}"
    )
