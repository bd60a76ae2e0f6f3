"""Gemma-2 and Gemma-3 (text): sandwich norms, attention-logit soft-capping, GeGLU, (1 + w) RMSNorms.

The attention's producers read ``input_layernorm``, the MLP's ``pre_feedforward_layernorm``; each block's
output goes through a post-norm (``post_attention_layernorm``, ``post_feedforward_layernorm``) before the
residual. An RMSNorm divides out a common scale of its input, so a compensator's scale (scaled-procrustes'
s*) has no effect there: the layer's prune records it (``rcpu_bench.pruning.layer_pass.post_norm_notes``).
Soft-capping and the query scalar act per head; Gemma-3's q/k norms are per head.
"""

from typing import TypedDict

from rcpu_bench.model.llama import Family


class _Norms(TypedDict):
    pre_norms: tuple[str, ...]
    post_norms: tuple[str, ...]


_SANDWICH = _Norms(pre_norms=("input_layernorm", "pre_feedforward_layernorm"),
                   post_norms=("post_attention_layernorm", "post_feedforward_layernorm"))
GEMMA2 = Family("Gemma2", ("gemma2",), logit_softcapping="final_logit_softcapping", **_SANDWICH)
GEMMA3 = Family("Gemma3", ("gemma3_text",), head_norms=("q_norm", "k_norm"),
                logit_softcapping="final_logit_softcapping", **_SANDWICH)
