"""A decoder's parameter count and training FLOPs per token, from its config alone (no arrays)."""

from __future__ import annotations

from jaxdist.config import ModelConfig


def count_params(cfg: ModelConfig, *, active: bool = False) -> int:
    """Parameter count from the config alone (no JAX arrays); ``active``: an MoE layer
    counts only the k routed experts a token uses (what its FLOPs follow)."""
    d, h, kv, hd, f, v = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.resolved_head_dim, cfg.resolved_mlp_dim, cfg.vocab_size
    attention = d * hd * (h + 2 * kv) + h * hd * d + 2 * d
    dense_layer = attention + 3 * d * f
    moe_layers = cfg.n_layers - cfg.moe_first_dense if cfg.moe_experts else 0
    routed = cfg.moe_top_k if active else cfg.moe_experts
    moe_layer = attention + d * cfg.moe_experts + 3 * d * cfg.resolved_moe_mlp_dim * (routed + cfg.moe_shared_experts)
    layers = (cfg.n_layers - moe_layers) * dense_layer + moe_layers * moe_layer
    if cfg.moe_bias_rate > 0:
        layers += moe_layers * cfg.moe_experts
    return v * d * (1 if cfg.tie_embeddings else 2) + layers + d


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x matmul params (an MoE layer's active experts only) +
    causal attention (PaLM appendix B)."""
    matmul_params = count_params(cfg, active=True) - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model)
    attention = 6 * cfg.n_layers * cfg.n_heads * cfg.resolved_head_dim * seq_len  # 12*L*H*Q*T, halved for causal
    return 6 * matmul_params + attention
