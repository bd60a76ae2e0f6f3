"""OLMo (parameter-free LayerNorms, clip_qkv) and OLMo-2 (post-norms only, q/k RMSNorms over all heads).

OLMo-2 normalises the concatenated queries of all heads (and the keys of all kv heads) with one RMSNorm:
removing a head changes the norm of every other head, which no re-weighting of the kept weights undoes.
Head pruning is refused before any work; MLP pruning is exact. OLMo's clip_qkv clamps each element,
so it acts per head.
"""

from rcpu_bench.model.llama import Family

OLMO = Family("OLMo", ("olmo",))
OLMO2 = Family("OLMo2", ("olmo2",),
               pre_norms=(), post_norms=("post_attention_layernorm", "post_feedforward_layernorm"),
               head_norms=("q_norm", "k_norm"),
               head_pruning_refused="its q_norm / k_norm normalise all heads together, so removing a head changes "
                                    "the kept heads' outputs; prune the MLP only (--prune mlp)")
