"""Depth pruning baselines as whole-model methods: ShortGPT and ReplaceMe (least-squares variant).

Both remove whole decoder layers; how many is chosen to match the parameters that width pruning at the same ρ
removes (``layers.matched_layer_count``: ⌊ρ·n⌋ units of every module, each unit's producer and consumer weights),
and the report records both counts.

- ShortGPT (Men et al. 2024): block influence BI_l = 1 − E_tokens[cos(x_in, x_out)] of each layer on the
  calibration tokens; the layers with the lowest BI go.
- ReplaceMe (Shopkhoev et al. 2025, LS variant): the run of n consecutive layers [i, i+n) whose input and output
  are closest in mean cosine distance is replaced by one linear map T applied to the MLP output M of layer i−1:
  T = argmin ‖M T − (X_out − R)‖² = (MᵀM)⁺ Mᵀ(X_out − R), R = X_in − M the rest of layer i−1's output, X_out
  the output of layer i+n−1, from the second-order statistics MᵀM and Mᵀ(X_out − R). T is merged into layer
  i−1's down_proj: W_down ← Tᵀ W_down (and its bias b ← Tᵀ b).

The shared part (the parameter match, the dense layer walk, removing layers) is ``layers``; each method is a module
(``shortgpt``, ``replaceme``), registered by ``plugin`` as a whole-model method with its ``check=``.
"""
