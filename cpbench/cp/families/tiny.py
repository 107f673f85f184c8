"""A tiny config of any causal-LM family: the family's own config class, shrunk (2 layers, hidden 64, 4 heads over 2
kv heads of 16, vocab 128, 4 experts of which 2 per token, small MLA ranks, a sliding layer beside a full one where the
family has both; a multimodal wrapper's sub-configs shrunk alike), with the family's features kept on: router aux
loss, sinks, soft-capping, QK norms, partial rotary; randomness off (dropout, router jitter). What the automated audit
builds every family from (audit.py), and the family parity matrix runs (tests/dist/test_families.py)."""

from __future__ import annotations

import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

VOCAB = 128
SHRINK = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False,
              pad_token_id=0, bos_token_id=1, eos_token_id=2, attention_dropout=0.0, hidden_dropout=0.0,
              dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layerdrop=0.0, hidden_dropout_prob=0.0,
              attention_probs_dropout_prob=0.0, activation_dropout=0.0, dropout_rate=0.0, residual_dropout=0.0,
              # random in training, as dropout is: two runs agree only statistically (phimoe's router jitter)
              router_jitter_noise=0.0, input_jitter_noise=0.0,
              # mixture of experts: few experts, the router's aux loss on
              num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2,
              moe_topk=2, moe_k=2, top_k=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
              output_router_logits=True, router_aux_loss_coef=0.01, n_shared_experts=1, n_group=1, topk_group=1,
              first_k_dense_replace=1,
              # multi-head latent attention: rope and nope parts of the query/key head, and a smaller value head
              q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
              sliding_window=8)
# What a family's default config needs beside SHRINK to build tiny, or to keep what makes it that family.
FIXUPS: dict[str, dict] = {
    "gpt_oss": dict(layer_types=["sliding_attention", "full_attention"]),
    "gemma2": dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=16),
    "dbrx": dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=1024, attn_config={"kv_n_heads": 2, "clip_qkv": 8.0,
                                                                                    "rope_theta": 10000.0},
                 ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2}),
    "gpt_neox": dict(rotary_pct=0.5),
    "phi": dict(partial_rotary_factor=0.5),
    "opt": dict(ffn_dim=64, word_embed_proj_dim=64),
    "ctrl": dict(n_embd=64, n_layer=2, n_head=4, dff=64, n_positions=1024),
    "jetmoe": dict(kv_channels=16),
    "longcat_flash": dict(num_layers=2, ffn_hidden_size=64, expert_ffn_hidden_size=32, zero_expert_num=2, moe_topk=2),
    "cohere_compass_text": dict(rope_parameters={kind: {"rope_type": "default", "rope_theta": 10000.0}
                                                 for kind in ("full_attention", "sliding_attention")}),
}
LAYER_LISTS = ("layer_types", "mlp_layer_types")  # one entry per layer
INDEX_LISTS = {"mlp_only_layers": [0]}  # layer indices: the first layer dense, the second a mixture of experts


def causal_lm_class(model_type: str) -> type:
    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def tiny_config(model_type: str):
    """The config class the family's causal LM takes, shrunk (its sub-configs too: a multimodal wrapper's vision tower
    and text model), with the family's FIXUPS."""
    config = _shrunk(causal_lm_class(model_type).config_class, FIXUPS.get(model_type, {}))
    config._attn_implementation = "eager"
    return config


def _shrunk(config_class, extra: dict):
    """SHRINK where the class knows the key; per-layer lists cut to the layer count, keeping one of each kind (a
    sliding layer beside a full one)."""
    default = config_class()
    known = set(default.to_dict())
    values = {k: v for k, v in SHRINK.items() if k in known}
    if "qk_rope_head_dim" in known:  # MLA: the rotary head is the rope part; every query head has its own key
        values.pop("head_dim", None)
        values["num_key_value_heads"] = values["num_attention_heads"]
        values.update({k: v for k, v in (("head_dim", SHRINK["qk_rope_head_dim"]), ("qk_head_dim", SHRINK[
            "qk_rope_head_dim"] + SHRINK["qk_nope_head_dim"])) if k in known})
    values.update({k: v for k, v in INDEX_LISTS.items() if k in known})
    for name in getattr(config_class, "sub_configs", {}):
        sub = getattr(default, name, None)
        if sub is not None and hasattr(sub, "to_dict"):  # its own class (the declared one may be AutoConfig)
            values[name] = _shrunk(type(sub), {}).to_dict()
    values.update(extra)
    config = config_class(**values)
    layers_n = getattr(config, "num_hidden_layers", None)
    for name in LAYER_LISTS:
        layers = getattr(config, name, None)
        if isinstance(layers, list) and layers_n and len(layers) != layers_n:
            kinds = list(dict.fromkeys(layers))[:layers_n]
            setattr(config, name, (kinds + layers)[:layers_n])
    return config
