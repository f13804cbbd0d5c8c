"""The zoo's architectures: tiny transformers configs (random weights, no download) and inputs.

Each `Spec` names a transformers model class, the smallest config that still exercises what
makes the family different (sliding windows, multi-query attention, tied or untied heads,
experts stored one by one but fused in the model, weight-norm parametrizations, relative
position tables, computed sinusoidal positions, ...), and the inputs of one forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

VOCAB = 96
SEQ = 6


@dataclass(frozen=True)
class Spec:
    """One architecture of the zoo.

    Attributes:
        name: short id (the pytest id).
        family: what it stands for ("decoder", "moe", "ssm", "hybrid", "encdec", "encoder",
            "vision", "audio", "multimodal").
        model_class: the transformers class name.
        config_class: the config class name.
        config: config keyword arguments (tiny).
        inputs: builds the forward's keyword arguments (seeded).
        generative: greedy ``generate`` and a KV-cache step are compared too.
        output: the output attribute compared bit for bit.
        slow: marked ``slow`` (still run in CI).
    """

    name: str
    family: str
    model_class: str
    config_class: str
    config: dict[str, Any]
    inputs: Callable[[], dict[str, torch.Tensor]]
    generative: bool = False
    output: str = "logits"
    slow: bool = False


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(3)


def tokens(vocab: int = VOCAB, seq: int = SEQ) -> Callable[[], dict[str, torch.Tensor]]:
    def make() -> dict[str, torch.Tensor]:
        return {"input_ids": torch.randint(3, vocab, (1, seq), generator=_gen())}

    return make


def seq2seq(vocab: int = VOCAB) -> Callable[[], dict[str, torch.Tensor]]:
    def make() -> dict[str, torch.Tensor]:
        g = _gen()
        return {
            "input_ids": torch.randint(3, vocab, (1, SEQ), generator=g),
            "decoder_input_ids": torch.randint(3, vocab, (1, 4), generator=g),
        }

    return make


def pixels(size: int = 32, channels: int = 3) -> Callable[[], dict[str, torch.Tensor]]:
    def make() -> dict[str, torch.Tensor]:
        return {"pixel_values": torch.randn(1, channels, size, size, generator=_gen())}

    return make


def audio(samples: int = 800) -> Callable[[], dict[str, torch.Tensor]]:
    def make() -> dict[str, torch.Tensor]:
        return {"input_values": torch.randn(1, samples, generator=_gen())}

    return make


def mel(bins: int = 16, frames: int = 32) -> Callable[[], dict[str, torch.Tensor]]:
    def make() -> dict[str, torch.Tensor]:
        g = _gen()
        return {
            "input_features": torch.randn(1, bins, frames, generator=g),
            "decoder_input_ids": torch.randint(3, VOCAB, (1, 4), generator=g),
        }

    return make


def text_and_image(size: int = 32) -> Callable[[], dict[str, torch.Tensor]]:
    def make() -> dict[str, torch.Tensor]:
        g = _gen()
        return {
            "input_ids": torch.randint(3, VOCAB, (2, SEQ), generator=g),
            "pixel_values": torch.randn(2, 3, size, size, generator=g),
        }

    return make


def llava_inputs() -> dict[str, torch.Tensor]:
    g = _gen()
    image_tokens = 4  # (image 16 / patch 8)^2 patches, CLS dropped ("default" feature select)
    ids = torch.randint(3, VOCAB - 1, (1, SEQ), generator=g)
    ids = torch.cat([ids[:, :1], torch.full((1, image_tokens), VOCAB - 1), ids[:, 1:]], dim=1)
    return {"input_ids": ids, "pixel_values": torch.randn(1, 3, 16, 16, generator=g)}


def mllama_inputs() -> dict[str, torch.Tensor]:
    """One image of ``max_num_tiles`` tiles (aspect ratio 1x2), attended to by every text token."""
    g = _gen()
    ids = torch.randint(3, VOCAB - 1, (1, SEQ), generator=g)
    ids[0, 0] = VOCAB - 1  # the image token
    return {
        "input_ids": ids,
        "pixel_values": torch.randn(1, 1, 2, 3, 16, 16, generator=g),
        "aspect_ratio_ids": torch.tensor([[2]]),
        "aspect_ratio_mask": torch.ones(1, 1, 2, dtype=torch.long),
        "cross_attention_mask": torch.ones(1, SEQ, 1, 2, dtype=torch.long),
    }


DEC = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
MOE = dict(DEC, num_local_experts=4, num_experts_per_tok=2)
ENC = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=48,
    max_position_embeddings=64,
    pad_token_id=0,
)
BART = dict(
    vocab_size=VOCAB,
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=48,
    decoder_ffn_dim=48,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    decoder_start_token_id=2,
    forced_eos_token_id=None,
)
T5 = dict(
    vocab_size=VOCAB,
    d_model=32,
    d_kv=8,
    d_ff=48,
    num_layers=2,
    num_decoder_layers=2,
    num_heads=4,
    relative_attention_num_buckets=8,
    decoder_start_token_id=0,
    pad_token_id=0,
    eos_token_id=1,
)
VIT = dict(
    image_size=32,
    patch_size=8,
    num_channels=3,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=48,
)
CLIP_TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=SEQ + 2,
)
CLIP_VISION = dict(
    image_size=32, patch_size=8, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4
)

SPECS: list[Spec] = [
    # decoders: dense, tied and untied heads, sliding window, multi-query, parallel blocks
    Spec(
        "gpt2",
        "decoder",
        "GPT2LMHeadModel",
        "GPT2Config",
        dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2),
        tokens(),
        generative=True,
    ),
    Spec(
        "gpt_neox",
        "decoder",
        "GPTNeoXForCausalLM",
        "GPTNeoXConfig",
        {**{k: v for k, v in DEC.items() if k != "num_key_value_heads"}, "tie_word_embeddings": False},  # no GQA
        tokens(),
        generative=True,
    ),
    Spec("llama", "decoder", "LlamaForCausalLM", "LlamaConfig", DEC, tokens(), generative=True),
    Spec(
        "llama_tied",
        "decoder",
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(DEC, tie_word_embeddings=True),
        tokens(),
        generative=True,
    ),
    Spec(
        "mistral",
        "decoder",
        "MistralForCausalLM",
        "MistralConfig",
        dict(DEC, sliding_window=4),
        tokens(),
        generative=True,
    ),
    Spec("qwen2", "decoder", "Qwen2ForCausalLM", "Qwen2Config", DEC, tokens(), generative=True),
    Spec("gemma", "decoder", "GemmaForCausalLM", "GemmaConfig", dict(DEC, head_dim=8), tokens(), generative=True),
    Spec(
        "falcon",
        "decoder",
        "FalconForCausalLM",
        "FalconConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            multi_query=True,
            new_decoder_architecture=False,
            parallel_attn=True,
            bos_token_id=1,
            eos_token_id=2,
        ),
        tokens(),
        generative=True,
    ),
    Spec(
        "gpt_bigcode",
        "decoder",
        "GPTBigCodeForCausalLM",
        "GPTBigCodeConfig",
        dict(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            multi_query=True,
            bos_token_id=1,
            eos_token_id=2,
        ),
        tokens(),
        generative=True,
    ),
    Spec("phi", "decoder", "PhiForCausalLM", "PhiConfig", dict(DEC, num_key_value_heads=4), tokens(), generative=True),
    Spec(
        "opt",
        "decoder",
        "OPTForCausalLM",
        "OPTConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            ffn_dim=48,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
        tokens(),
        generative=True,
    ),
    # mixture of experts: experts stored one by one, fused in the model
    Spec("mixtral", "moe", "MixtralForCausalLM", "MixtralConfig", MOE, tokens(), generative=True, slow=True),
    Spec(
        "qwen2_moe",
        "moe",
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        dict(
            DEC,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=32,
            decoder_sparse_step=1,
        ),
        tokens(),
        generative=True,
    ),
    Spec(
        "qwen3_moe",
        "moe",
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        dict(DEC, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1),
        tokens(),
        generative=True,
    ),
    Spec(
        "deepseek_v3",
        "moe",
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        dict(
            DEC,
            moe_intermediate_size=24,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            num_key_value_heads=4,
        ),
        tokens(),
        generative=True,
    ),
    Spec(
        "olmoe",
        "moe",
        "OlmoeForCausalLM",
        "OlmoeConfig",
        dict(DEC, num_experts=4, num_experts_per_tok=2),
        tokens(),
        generative=True,
    ),
    # state space
    Spec(
        "mamba",
        "ssm",
        "MambaForCausalLM",
        "MambaConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            state_size=8,
            num_hidden_layers=2,
            expand=2,
            conv_kernel=4,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            use_mambapy=False,
        ),
        tokens(),
        generative=True,
    ),
    Spec(
        "mamba2",
        "ssm",
        "Mamba2ForCausalLM",
        "Mamba2Config",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            state_size=8,
            num_hidden_layers=2,
            expand=2,
            conv_kernel=4,
            num_heads=8,
            head_dim=8,
            n_groups=1,
            chunk_size=8,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
        tokens(),
        generative=True,
    ),
    # hybrids: recurrent or convolutional layers beside attention (states derived from the model)
    Spec(
        "jamba",
        "hybrid",
        "JambaForCausalLM",
        "JambaConfig",
        dict(
            DEC,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=2,
            num_experts_per_tok=1,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_dt_rank=4,
            use_mamba_kernels=False,
        ),
        tokens(),
        generative=True,
    ),
    Spec(
        "bamba",
        "hybrid",
        "BambaForCausalLM",
        "BambaConfig",
        dict(
            DEC,
            attn_layer_indices=[1],
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_d_state=8,
            mamba_n_groups=1,
            mamba_expand=2,
            mamba_d_conv=4,
            mamba_chunk_size=8,
        ),
        tokens(),
        generative=True,
    ),
    Spec(
        "falcon_h1",  # every layer holds a state and keys and values at once
        "hybrid",
        "FalconH1ForCausalLM",
        "FalconH1Config",
        dict(
            DEC,
            mamba_n_heads=4,
            mamba_d_ssm=64,
            mamba_d_head=16,
            mamba_d_state=8,
            mamba_n_groups=1,
            mamba_expand=2,
            mamba_d_conv=4,
            mamba_chunk_size=8,
        ),
        tokens(),
        generative=True,
    ),
    Spec(
        "zamba2",  # a shared attention block, twice as wide as hidden / heads
        "hybrid",
        "Zamba2ForCausalLM",
        "Zamba2Config",
        dict(
            DEC,
            num_hidden_layers=4,
            layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
            mamba_d_state=8,
            mamba_headdim=8,
            n_mamba_heads=8,
            mamba_ngroups=1,
            mamba_expand=2,
            mamba_d_conv=4,
            chunk_size=8,
            use_mem_rope=True,
        ),
        tokens(),
        generative=True,
        slow=True,
    ),
    Spec(
        "qwen3_next",  # gated DeltaNet layers beside gated attention, experts
        "hybrid",
        "Qwen3NextForCausalLM",
        "Qwen3NextConfig",
        dict(
            DEC,
            head_dim=8,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            layer_types=["linear_attention", "full_attention"],
        ),
        tokens(),
        generative=True,
        slow=True,
    ),
    Spec(
        "lfm2",
        "hybrid",
        "Lfm2ForCausalLM",
        "Lfm2Config",
        dict(DEC, conv_L_cache=3, layer_types=["conv", "full_attention"]),
        tokens(),
        generative=True,
    ),
    Spec(
        "recurrent_gemma",  # RG-LRU states kept on its modules, a local-attention window
        "hybrid",
        "RecurrentGemmaForCausalLM",
        "RecurrentGemmaConfig",
        dict(
            DEC,
            num_hidden_layers=3,
            num_key_value_heads=1,
            lru_width=48,
            attention_window_size=4,
            conv1d_width=4,
            block_types=["recurrent", "recurrent", "attention"],
        ),
        tokens(),
        generative=True,
    ),
    # encoder-decoders
    Spec(
        "t5",
        "encdec",
        "T5ForConditionalGeneration",
        "T5Config",
        T5,
        seq2seq(),
        generative=True,
        slow=True,
    ),
    Spec("bart", "encdec", "BartForConditionalGeneration", "BartConfig", BART, seq2seq(), generative=True, slow=True),
    Spec(
        "marian",
        "encdec",
        "MarianMTModel",
        "MarianConfig",
        dict(BART, decoder_start_token_id=0, share_encoder_decoder_embeddings=True),
        seq2seq(),
        generative=True,
    ),
    Spec(
        "whisper",
        "encdec",
        "WhisperForConditionalGeneration",
        "WhisperConfig",
        dict(
            vocab_size=VOCAB,
            num_mel_bins=16,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=48,
            decoder_ffn_dim=48,
            d_model=32,
            max_source_positions=16,
            max_target_positions=32,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=1,
            begin_suppress_tokens=None,
            suppress_tokens=None,
        ),
        mel(),
        generative=True,
        slow=True,
    ),
    Spec(
        "umt5",
        "encdec",
        "UMT5ForConditionalGeneration",
        "UMT5Config",
        dict(T5, d_kv=12),  # heads wider than d_model / heads: the cache says how wide
        seq2seq(),
        generative=True,
    ),
    Spec("pegasus", "encdec", "PegasusForConditionalGeneration", "PegasusConfig", BART, seq2seq(), generative=True),
    Spec(
        "led",
        "encdec",
        "LEDForConditionalGeneration",
        "LEDConfig",
        dict(BART, max_encoder_position_embeddings=64, max_decoder_position_embeddings=64, attention_window=[4, 4]),
        seq2seq(),
        generative=True,
        slow=True,
    ),
    # encoders
    Spec("bert", "encoder", "BertForMaskedLM", "BertConfig", ENC, tokens()),
    Spec("roberta", "encoder", "RobertaForMaskedLM", "RobertaConfig", dict(ENC, pad_token_id=1), tokens()),
    Spec(
        "albert",
        "encoder",
        "AlbertForMaskedLM",
        "AlbertConfig",
        dict(ENC, embedding_size=16, num_hidden_groups=2),
        tokens(),
    ),
    Spec(
        "deberta_v2",
        "encoder",
        "DebertaV2ForMaskedLM",
        "DebertaV2Config",
        dict(
            ENC,
            relative_attention=True,
            position_buckets=8,
            max_relative_positions=16,
            pos_att_type=["p2c", "c2p"],
            position_biased_input=False,
        ),
        tokens(),
    ),
    # vision
    Spec("vit", "vision", "ViTForImageClassification", "ViTConfig", dict(VIT, num_labels=3), pixels()),
    Spec(
        "swin",
        "vision",
        "SwinForImageClassification",
        "SwinConfig",
        dict(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4, num_labels=3),
        pixels(),
    ),
    Spec(
        "convnext",
        "vision",
        "ConvNextForImageClassification",
        "ConvNextConfig",
        dict(num_channels=3, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3),
        pixels(),
    ),
    # audio
    Spec(
        "wav2vec2",
        "audio",
        "Wav2Vec2ForCTC",
        "Wav2Vec2Config",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=48,
            conv_dim=(16, 16),
            conv_stride=(5, 4),
            conv_kernel=(10, 4),
            num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=4,
            do_stable_layer_norm=False,
            feat_extract_norm="group",
        ),
        audio(),
    ),
    # multimodal
    Spec(
        "clip",
        "multimodal",
        "CLIPModel",
        "CLIPConfig",
        dict(text_config=CLIP_TEXT, vision_config=CLIP_VISION, projection_dim=16),
        text_and_image(),
        output="logits_per_image",
    ),
    Spec(
        "siglip",
        "multimodal",
        "SiglipModel",
        "SiglipConfig",
        dict(text_config=dict(CLIP_TEXT, max_position_embeddings=SEQ), vision_config=CLIP_VISION),
        text_and_image(),
        output="logits_per_image",
    ),
    Spec(
        "llava",
        "multimodal",
        "LlavaForConditionalGeneration",
        "LlavaConfig",
        dict(
            text_config=dict(DEC, model_type="llama"),
            vision_config=dict(CLIP_VISION, image_size=16, model_type="clip_vision_model"),
            image_token_index=VOCAB - 1,
            projector_hidden_act="gelu",
            vision_feature_layer=-1,
        ),
        llava_inputs,
        generative=True,
    ),
]

# Mllama plans and generates, and its run is planned (tests/zoo/test_zoo_run.py); its loads with
# blocks on disk wait for offloaded weights to stop reading as ``meta`` in ``pixel_values.to(
# weight.device)`` (the nothing-lost issue), so it is not in SPECS yet.
MLLAMA = Spec(
    "mllama",  # cross-attention layers cache the vision states: tiles x (patches + 1) tokens
    "multimodal",
    "MllamaForConditionalGeneration",
    "MllamaConfig",
    dict(
        text_config=dict(
            DEC,
            num_hidden_layers=4,
            cross_attention_layers=[1, 3],
            rope_scaling={"rope_type": "default"},
        ),
        vision_config=dict(
            hidden_size=16,
            intermediate_size=24,
            num_hidden_layers=2,
            num_global_layers=1,
            attention_heads=2,
            image_size=16,
            patch_size=8,
            max_num_tiles=2,
            vision_output_dim=32,
            intermediate_layers_indices=[0],
            supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]],
        ),
        image_token_index=VOCAB - 1,
    ),
    mllama_inputs,
    generative=True,
    slow=True,
)

# Newer decoders whose run is planned and checked against generate (tests/zoo/test_zoo_run.py):
# sliding and full layers (Gemma 3, Cohere 2, EXAONE 4), attention sinks (gpt-oss), chunked
# attention and no-rope layers (Llama 4 text, SmolLM3), multipliers and other layouts. Their
# loads and offloads are not checked by tests/zoo/test_zoo.py yet.
_ALTERNATING = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])
RUN_SPECS: list[Spec] = [
    Spec(
        "gpt_oss",  # sinks, alternating sliding and full layers, experts
        "moe",
        "GptOssForCausalLM",
        "GptOssConfig",
        dict(DEC, head_dim=8, num_local_experts=4, num_experts_per_tok=2, **_ALTERNATING),
        tokens(),
        generative=True,
    ),
    Spec(
        "llama4_text",  # chunked attention (chunk 4 < the run's 8 tokens), a no-rope layer, experts
        "moe",
        "Llama4ForCausalLM",
        "Llama4TextConfig",
        dict(
            DEC,
            head_dim=8,
            num_local_experts=2,
            num_experts_per_tok=1,
            intermediate_size_mlp=48,
            attention_chunk_size=4,
            no_rope_layers=[1, 0],
            interleave_moe_layer_step=1,
        ),
        tokens(),
        generative=True,
    ),
    Spec(
        "gemma3_text",
        "decoder",
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        dict(DEC, head_dim=8, **_ALTERNATING),
        tokens(),
        generative=True,
        slow=True,
    ),
    Spec("cohere2", "decoder", "Cohere2ForCausalLM", "Cohere2Config", dict(DEC, **_ALTERNATING), tokens(), True, slow=True),
    Spec("exaone4", "decoder", "Exaone4ForCausalLM", "Exaone4Config", dict(DEC, **_ALTERNATING), tokens(), True, slow=True),
    Spec(
        "smollm3", "decoder", "SmolLM3ForCausalLM", "SmolLM3Config", dict(DEC, no_rope_layers=[1, 0]), tokens(), True,
        slow=True,
    ),
    Spec("glm4", "decoder", "Glm4ForCausalLM", "Glm4Config", dict(DEC, head_dim=8), tokens(), True, slow=True),
    Spec(
        "granite", "decoder", "GraniteForCausalLM", "GraniteConfig",
        dict(DEC, embedding_multiplier=2.0, residual_multiplier=0.5), tokens(), True, slow=True,
    ),
    Spec("nemotron", "decoder", "NemotronForCausalLM", "NemotronConfig", dict(DEC, head_dim=8), tokens(), True, slow=True),
    Spec(
        "persimmon", "decoder", "PersimmonForCausalLM", "PersimmonConfig",
        {k: v for k, v in DEC.items() if k != "num_key_value_heads"}, tokens(), True, slow=True,
    ),
    Spec("phimoe", "moe", "PhimoeForCausalLM", "PhimoeConfig", MOE, tokens(), True, slow=True),
    Spec(
        "dbrx", "moe", "DbrxForCausalLM", "DbrxConfig",
        dict(
            vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=64, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=10000.0),
            ffn_config=dict(ffn_hidden_size=48, moe_num_experts=4, moe_top_k=2),
        ),
        tokens(), True, slow=True,
    ),
]  # fmt: skip

BY_NAME = {spec.name: spec for spec in [*SPECS, MLLAMA, *RUN_SPECS]}


def build_config(spec: Spec) -> Any:
    import transformers

    return getattr(transformers, spec.config_class)(**spec.config)


def model_class(spec: Spec) -> type:
    import transformers

    return getattr(transformers, spec.model_class)
