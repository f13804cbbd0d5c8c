"""KV cache and activations: bigviz's predictions against a measured generate, and what
transformers' weights-only map (``from_pretrained(device_map="auto")``) leaves for the run.

    python bench/workload.py            # prints a markdown section (about a minute here)

1. Accuracy: tiny models of every cache layout are dispatched by bigviz with one layer on
   disk, run through ``generate``, and measured: the bytes of the cache's storages per device
   against ``plan.kv_cache``, and the prefill's peak of live tensors (a TorchDispatchMode
   tracker, the cache's storages left out) against ``plan.activations``.
2. Will it fit: shipped configs on meta, placed as ``from_pretrained(device_map="auto")`` places
   them (transformers' ``_get_device_map``: accelerate's ``get_balanced_memory``, then
   ``infer_auto_device_map`` under those budgets; weights only) and planned by bigviz with the
   run and 1.5 GiB of headroom per GPU (CUDA context, allocator, workspaces); the run's KV cache
   and activations are then charged on transformers' map to show whether it runs out of memory.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bigviz  # noqa: E402
from bigviz.core.devices import device_label
from bigviz.core.sizes import format_size  # noqa: E402
from bigviz.modeling.memory import measure_generate  # noqa: E402
from bigviz.models import build  # noqa: E402

BATCH, PROMPT, NEW, WINDOW = 2, 40, 4, 16
GiB = 2**30
HEADROOM = 3 * GiB // 2  # per GPU: the CUDA context, the allocator's fragmentation, cuBLAS and attention workspaces


def tiny_models() -> dict[str, tuple[str, torch.nn.Module]]:
    import transformers as T

    def hf(config: object) -> torch.nn.Module:
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return T.AutoModelForCausalLM.from_config(config).eval()

    def own(name: str, **kw: object) -> torch.nn.Module:
        torch.manual_seed(0)
        return build(name, vocab_size=160, **kw).eval()

    return {
        "GPT-2": (
            "full, 4 heads",
            hf(
                T.GPT2Config(
                    n_layer=3, n_head=4, n_embd=48, vocab_size=160, n_positions=128, bos_token_id=0, eos_token_id=0
                )
            ),
        ),
        "Llama": (
            "grouped-query 4/2",
            hf(
                T.LlamaConfig(
                    hidden_size=64,
                    intermediate_size=160,
                    num_hidden_layers=3,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    vocab_size=160,
                )
            ),
        ),
        "Mistral": (
            f"sliding window {WINDOW}",
            hf(
                T.MistralConfig(
                    hidden_size=64,
                    intermediate_size=128,
                    num_hidden_layers=3,
                    num_attention_heads=8,
                    num_key_value_heads=2,
                    vocab_size=160,
                    sliding_window=WINDOW,
                )
            ),
        ),
        "Gemma 2": (
            "sliding / full, eager",
            hf(
                T.Gemma2Config(
                    hidden_size=48,
                    intermediate_size=96,
                    num_hidden_layers=4,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    head_dim=16,
                    vocab_size=160,
                    sliding_window=WINDOW,
                )
            ),
        ),
        "Mixtral": (
            "grouped-query 4/1, 4 experts",
            hf(
                T.MixtralConfig(
                    hidden_size=48,
                    intermediate_size=96,
                    num_hidden_layers=3,
                    num_attention_heads=4,
                    num_key_value_heads=1,
                    vocab_size=160,
                    num_local_experts=4,
                    num_experts_per_tok=2,
                )
            ),
        ),
        "DeepSeek-V3": (
            "latent 24 + rope 8, 8 experts",
            hf(
                T.DeepseekV3Config(
                    hidden_size=64,
                    intermediate_size=128,
                    moe_intermediate_size=32,
                    num_hidden_layers=3,
                    num_attention_heads=4,
                    num_key_value_heads=4,
                    vocab_size=160,
                    kv_lora_rank=24,
                    q_lora_rank=48,
                    qk_rope_head_dim=8,
                    qk_nope_head_dim=16,
                    v_head_dim=16,
                    n_routed_experts=8,
                    num_experts_per_tok=2,
                    n_group=2,
                    topk_group=1,
                    first_k_dense_replace=1,
                    n_shared_experts=1,
                )
            ),
        ),
        "Mamba": (
            "conv + SSM state",
            hf(
                T.MambaConfig(
                    hidden_size=48, num_hidden_layers=3, vocab_size=160, state_size=8, expand=2, conv_kernel=4
                )
            ),
        ),
        "bigviz GPT": ("full, 2 heads", own("gpt-tiny", n_layer=3)),
        "bigviz Llama": ("grouped-query 4/2", own("llama-tiny", n_layers=3)),
        **hybrid_models(hf),
    }


HYBRID = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def hybrid_models(hf) -> dict[str, tuple[str, torch.nn.Module]]:  # type: ignore[no-untyped-def]
    """Recurrent and hybrid layouts: states read from the model (bigviz/modeling/cache_probe.py)."""
    import transformers as T

    mamba2 = dict(mamba_d_state=8, mamba_n_groups=1, mamba_expand=2, mamba_d_conv=4, mamba_chunk_size=16)
    return {
        "Mamba-2": (
            "conv + SSM state per head",
            hf(
                T.Mamba2Config(
                    vocab_size=160, hidden_size=48, state_size=8, num_hidden_layers=3, expand=2, conv_kernel=4,
                    num_heads=12, head_dim=8, n_groups=1, chunk_size=16,
                )
            ),
        ),
        "Jamba": (
            "Mamba + attention, experts",
            hf(
                T.JambaConfig(
                    **HYBRID, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                    num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                    mamba_dt_rank=8, use_mamba_kernels=False,
                )
            ),
        ),
        "Bamba": (
            "Mamba-2 + attention",
            hf(T.BambaConfig(**HYBRID, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32, **mamba2)),
        ),
        "Falcon-H1": (
            "state + KV in every layer",
            hf(T.FalconH1Config(**HYBRID, mamba_n_heads=4, mamba_d_ssm=128, mamba_d_head=32, **mamba2)),
        ),
        "Zamba2": (
            "Mamba-2 + shared attention (2x wide)",
            hf(
                T.Zamba2Config(
                    **{**HYBRID, "num_hidden_layers": 4}, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
                    mamba_d_state=8, mamba_headdim=16, n_mamba_heads=8, mamba_ngroups=1, mamba_expand=2,
                    mamba_d_conv=4, chunk_size=16, use_mem_rope=True,
                )
            ),
        ),
        "Qwen3-Next": (
            "gated DeltaNet + attention, experts",
            hf(
                T.Qwen3NextConfig(
                    **HYBRID, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                    linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=32, shared_expert_intermediate_size=32,
                    layer_types=["linear_attention", "full_attention", "linear_attention"],
                )
            ),
        ),
        "LFM2": (
            "short conv + attention",
            hf(T.Lfm2Config(**HYBRID, conv_L_cache=3, layer_types=["conv", "full_attention", "conv"])),
        ),
        "RecurrentGemma": (
            f"RG-LRU (on its modules) + window {WINDOW}",
            hf(
                T.RecurrentGemmaConfig(
                    **{**HYBRID, "num_key_value_heads": 1}, lru_width=64, attention_window_size=WINDOW, conv1d_width=4,
                    block_types=["recurrent", "recurrent", "attention"],
                )
            ),
        ),
    }  # fmt: skip


def encoder_decoders() -> dict[str, tuple[str, torch.nn.Module, dict[str, torch.Tensor]]]:
    """Encoder-decoders and cross-attention: each with the inputs ``generate`` takes."""
    import transformers as T

    def build(cls: type, config: object) -> torch.nn.Module:
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return cls(config).eval()

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 150, (BATCH, PROMPT), generator=g)
    bart = dict(
        vocab_size=160,
        d_model=64,
        encoder_layers=2,
        decoder_layers=3,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=128,
        decoder_start_token_id=2,
        forced_eos_token_id=None,
    )
    from tests.zoo.specs import MLLAMA, build_config, mllama_inputs

    mllama = {k: v.expand(BATCH, *v.shape[1:]).clone() for k, v in mllama_inputs().items()}
    mllama["input_ids"] = torch.cat([mllama["input_ids"], ids[:, : PROMPT - mllama["input_ids"].shape[1]] % 90], 1)
    mllama["cross_attention_mask"] = torch.ones(BATCH, PROMPT, 1, 2, dtype=torch.long)
    return {
        "T5": (
            "self + cross over the encoder",
            build(T.T5ForConditionalGeneration, T.T5Config(
                vocab_size=160, d_model=64, d_kv=24, d_ff=128, num_layers=3, num_decoder_layers=3, num_heads=4,
                relative_attention_num_buckets=8, decoder_start_token_id=0,
            )),
            {"input_ids": ids},
        ),
        "BART": ("self + cross over the encoder", build(T.BartForConditionalGeneration, T.BartConfig(**bart)),
                 {"input_ids": ids}),
        "Whisper": (
            "self + cross over 32 frames",
            build(T.WhisperForConditionalGeneration, T.WhisperConfig(
                vocab_size=160, num_mel_bins=16, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, d_model=64,
                max_source_positions=32, max_target_positions=64, decoder_start_token_id=1, pad_token_id=0,
                bos_token_id=1, eos_token_id=2,
                begin_suppress_tokens=None, suppress_tokens=None,
            )),
            {"input_features": torch.randn(BATCH, 16, 64, generator=g)},
        ),
        "Mllama": ("self + cross over one image's tiles", build(T.MllamaForConditionalGeneration, build_config(MLLAMA)),
                   mllama),
    }  # fmt: skip


def accuracy(folder: Path) -> Iterator[str]:
    """The accuracy table's lines, each row as soon as it is measured."""
    yield (
        "| model | cache | KV at the end: predicted | measured | KV peak: planned | measured "
        "| activations predicted | measured | ratio |"
    )
    yield "|---|---|---:|---:|---:|---:|---:|---:|---:|"
    ids = torch.randint(3, 150, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))
    for name, (layout, model) in tiny_models().items():
        yield _accuracy_row(name, layout, model, {"input_ids": ids}, folder)
    for name, (layout, model, inputs) in encoder_decoders().items():
        yield _accuracy_row(name, layout, model, inputs, folder)


def _accuracy_row(name: str, layout: str, model: torch.nn.Module, inputs: dict[str, torch.Tensor], folder: Path) -> str:
    """One model dispatched with its second layer on disk: the cache at the end and at its
    peak, and the prefill's activations, predicted and measured (reserve=0: the arithmetic)."""
    encdec = getattr(getattr(model, "config", None), "is_encoder_decoder", False)
    first, *_ = inputs.values()
    if encdec:  # the decoder starts from its start token; the encoder reads the whole input
        with torch.no_grad():
            source = model.get_encoder()(**inputs).last_hidden_state.shape[1]
        context, prompt = NEW, 1
    else:
        source, context, prompt = None, PROMPT + NEW - 1, PROMPT
    run_of = dict(batch_size=BATCH, encoder_length=source, reserve=0)
    layers = sorted(bigviz.kv_cache_bytes(model, 1, 1))
    plan = bigviz.plan(model, {"cpu": "2GB"}, context_length=context, overrides={layers[1]: "disk"}, **run_of)
    prefill = bigviz.plan(model, {"cpu": "2GB"}, context_length=prompt, **run_of)
    dispatched = bigviz.dispatch_model(model, plan.device_map, offload_folder=folder / name)
    own = type(model).__module__.startswith("bigviz.models")
    kwargs: dict[str, object] = {} if own else dict(do_sample=False, pad_token_id=0, min_new_tokens=NEW)
    if not own:
        kwargs.update({k: v for k, v in inputs.items() if v is not first})
        if not encdec and "attention_mask" not in kwargs:
            kwargs["attention_mask"] = torch.ones_like(first)
    run = measure_generate(dispatched, first, NEW, **kwargs)
    end_p = sum(bigviz.kv_cache_bytes(model, BATCH, context, encoder_length=source).values())
    end_m, peak_m = run.cache_bytes.get("cpu", 0), run.cache_peak.get("cpu", 0)
    act_p, act_m = prefill.activations["cpu"], run.prefill_activations
    return (
        f"| {name} | {layout} | {end_p:,} B | {end_m:,} B | {plan.kv_cache['cpu']:,} B | {peak_m:,} B "
        f"| {format_size(act_p)} | {format_size(act_m)} | {act_p / act_m:.2f} |"
    )


def will_it_fit() -> list[str]:
    import logging

    from accelerate.utils import get_balanced_memory, infer_auto_device_map

    logging.getLogger("accelerate").setLevel(logging.ERROR)  # "Device 0 is not available": we plan for it

    cases = [
        ("llama-3.1-70b", 1, 32768, {0: 80 * GiB, 1: 80 * GiB, "cpu": 340 * GiB}),
        ("llama-3.1-8b", 8, 8192, {0: 24 * GiB, "cpu": 64 * GiB}),
        ("mixtral-8x7b", 4, 32768, {0: 80 * GiB, 1: 80 * GiB, "cpu": 340 * GiB}),
        ("qwen2.5-72b", 1, 32768, {0: 80 * GiB, 1: 80 * GiB, "cpu": 340 * GiB}),
    ]
    rows = [
        "| model, run | hardware | transformers' map: free after weights | the run needs there | "
        f"bigviz plan, {format_size(HEADROOM)} headroom per GPU | longest context (no offload, headroom) |",
        "|---|---|---|---|---|---:|",
    ]
    for name, batch, context, budgets in cases:
        model = bigviz.resolve_model(bigviz.config_path(name))
        no_split = list(model._no_split_modules)
        # as from_pretrained(device_map="auto") does (transformers' _get_device_map): balance, then fill
        balanced = get_balanced_memory(model, max_memory=dict(budgets), no_split_module_classes=no_split)
        acc_map = infer_auto_device_map(model, max_memory=balanced, no_split_module_classes=no_split)
        acc_map = {k: ("cpu" if v == "cpu" else v) for k, v in acc_map.items()}
        weights = bigviz.plan(model, budgets, overrides=acc_map)  # accelerate's placement, weights only
        on_acc = bigviz.plan(
            model,
            {**budgets, **{d: 10**15 for d in budgets}},
            overrides=acc_map,
            batch_size=batch,
            context_length=context,
        )  # its run, budgets lifted
        gpus = [d for d in budgets if isinstance(d, int)]
        offloaded_by_hf = sum(weights.offloaded_bytes().values())
        free = ", ".join(f"{device_label(d)} {format_size(weights.usage_of(d).free)}" for d in gpus)
        needs = {d: on_acc.usage_of(d).kv_cache + on_acc.usage_of(d).activations for d in gpus}
        need = ", ".join(f"{device_label(d)} {format_size(n)}" for d, n in needs.items())
        short = [d for d in gpus if needs[d] > weights.usage_of(d).free]
        tight = [d for d in gpus if d not in short and needs[d] + HEADROOM > weights.usage_of(d).free]
        need += (
            f" (out of memory on {', '.join(device_label(d) for d in short)})"
            if short
            else f" (less than {format_size(HEADROOM)} to spare on {', '.join(device_label(d) for d in tight)})"
            if tight
            else " (fits, headroom kept)"
        ) + (f"; it offloads {format_size(offloaded_by_hf)}" if offloaded_by_hf else "")
        reserve = {d: HEADROOM for d in gpus}
        ours = bigviz.plan(model, budgets, batch_size=batch, context_length=context, reserve=reserve)
        offloaded = sum(ours.offloaded_bytes().values())
        verdict = "fits on the GPUs" if not offloaded else f"offloads {format_size(offloaded)} to fit"
        longest = bigviz.max_context(model, budgets, batch, reserve=reserve)
        hardware = " + ".join(f"{format_size(b)}" for d, b in budgets.items() if isinstance(d, int))
        rows.append(f"| {name}, {batch} x {context:,} | {hardware} | {free} | {need} | {verdict} | {longest:,} |")
    return rows


def main() -> None:
    import tempfile

    print("## KV cache and activations (`python bench/workload.py`)\n")
    print(
        f"Tiny models, batch {BATCH}, prompt {PROMPT}, {NEW} new tokens, one layer on disk; measured on "
        f"this CPU after `generate` (KV: storages per device; activations: the prefill's peak of live "
        f"tensors without the cache).\n"
    )
    with tempfile.TemporaryDirectory() as folder:
        print("\n".join(accuracy(Path(folder))))
    print(
        "\nShipped configs on meta (bf16): the weights-only map of from_pretrained(device_map='auto') against "
        "the run it must hold.\n"
    )
    print("\n".join(will_it_fit()))


if __name__ == "__main__":
    main()
