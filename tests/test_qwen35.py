"""Qwen3.5, the hybrid of Gated DeltaNet layers and gated full attention: against transformers (the
file's weights taken back through llama.cpp's conversion), and its state as a slot is fed, resumed and
copied."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from kiln.engine.native import NativeEngine
from kiln.engine.oracle import OracleEngine
from kiln.errors import ModelFileError
from kiln.gguf import GGUFFile
from kiln.models import family_for
from kiln.models.base import Attention, DeltaNet
from kiln.synth import write_random_gguf
from tests.reference import Builder, hf_greedy, hf_logits, oracle, oracle_greedy, register_builder, rel_err
from tests.test_native import kld

IDS = [int(i) for i in np.random.default_rng(7).integers(3, 500, 40)]


def _hf_config(meta: dict) -> dict:
    a = meta["general.architecture"]
    head_dim = meta[f"{a}.attention.key_length"]
    return dict(model_type="qwen3_5_text", vocab_size=len(meta["tokenizer.ggml.token_type"]),
                hidden_size=meta[f"{a}.embedding_length"], intermediate_size=meta[f"{a}.feed_forward_length"],
                num_hidden_layers=meta[f"{a}.block_count"], num_attention_heads=meta[f"{a}.attention.head_count"],
                num_key_value_heads=meta[f"{a}.attention.head_count_kv"], head_dim=head_dim,
                rms_norm_eps=meta[f"{a}.attention.layer_norm_rms_epsilon"],
                max_position_embeddings=meta[f"{a}.context_length"],
                rope_parameters={"rope_type": "default", "rope_theta": meta[f"{a}.rope.freq_base"],
                                 "partial_rotary_factor": meta[f"{a}.rope.dimension_count"] / head_dim,
                                 "mrope_section": meta[f"{a}.rope.dimension_sections"][:3]},
                linear_conv_kernel_dim=meta[f"{a}.ssm.conv_kernel"], linear_key_head_dim=meta[f"{a}.ssm.state_size"],
                linear_num_key_heads=meta[f"{a}.ssm.group_count"],
                linear_num_value_heads=meta[f"{a}.ssm.time_step_rank"],
                linear_value_head_dim=meta[f"{a}.ssm.inner_size"] // meta[f"{a}.ssm.time_step_rank"],
                full_attention_interval=meta[f"{a}.full_attention_interval"],
                tie_word_embeddings="output.weight" not in meta.get("tensors", ()), pad_token_id=None,
                bos_token_id=None, eos_token_id=None)


_NAMES = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
          "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
          "ssm_alpha": "linear_attn.in_proj_a", "ssm_beta": "linear_attn.in_proj_b",
          "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def _hf_name(name: str) -> str | None:
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if name in top:
        return top[name]
    parts = name.split(".")
    layer, tensor = parts[1], parts[2]
    if tensor == "ssm_a":
        return f"model.layers.{layer}.linear_attn.A_log"
    if tensor == "ssm_dt":
        return f"model.layers.{layer}.linear_attn.dt_bias"
    return f"model.layers.{layer}.{_NAMES[tensor]}.{parts[3]}"


def _unconvert(path):
    """llama.cpp's conversion undone: norms stored as 1 + w, A as -exp(A_log), the convolution squeezed,
    and the value heads in tiled order (transformers groups them by key head)."""
    meta = GGUFFile(path).metadata
    n_k, n_v = meta["qwen35.ssm.group_count"], meta["qwen35.ssm.time_step_rank"]
    k_width, v_dim = n_k * meta["qwen35.ssm.state_size"], meta["qwen35.ssm.inner_size"] // n_v

    def grouped(t, dim, head):  # tiled [r][n_k] → grouped [n_k][r], along `dim`
        shape = list(t.shape)
        t = t.reshape(*shape[:dim], n_v // n_k, n_k, head, *shape[dim + 1:])
        return t.transpose(dim, dim + 1).reshape(shape)

    def join(state: dict) -> dict:
        out = {}
        for name, t in state.items():
            if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
                t = t - 1
            elif name.endswith("A_log"):
                t = grouped(torch.log(-t[:, None]), 0, 1)[:, 0]
            elif name.endswith("dt_bias"):
                t = grouped(t[:, None], 0, 1)[:, 0]
            elif name.endswith("in_proj_qkv.weight"):
                t = torch.cat([t[: 2 * k_width], grouped(t[2 * k_width :], 0, v_dim)])
            elif name.endswith("conv1d.weight"):
                t = torch.cat([t[: 2 * k_width], grouped(t[2 * k_width :], 0, v_dim)])[:, None, :]
            elif name.endswith("in_proj_z.weight"):
                t = grouped(t, 0, v_dim)
            elif name.endswith(("in_proj_a.weight", "in_proj_b.weight")):
                t = grouped(t, 0, 1)
            elif name.endswith("out_proj.weight"):
                t = grouped(t, 1, v_dim)
            out[name] = t
        return out

    return join


def _builder(path) -> Builder:
    tied = "output.weight" not in GGUFFile(path).tensors
    return Builder(config=lambda meta: {**_hf_config(meta), "tie_word_embeddings": tied}, name=_hf_name,
                   join=_unconvert(path))


@pytest.fixture(scope="module")
def f32_path(tmp_path_factory):
    path = write_random_gguf(tmp_path_factory.mktemp("qwen35") / "qwen35.gguf", "tiny-qwen35", qtype=QT.F32, seed=11)
    register_builder("qwen35", _builder(path))
    return path


def engines(path, n_slots=1, n_ctx=160, **native_options):
    gguf = GGUFFile(path)
    fam = family_for(gguf)
    native = NativeEngine(gguf, fam, n_ctx=n_ctx, n_slots=n_slots, threads=2, **native_options)
    return native, OracleEngine(gguf, fam, n_ctx=n_ctx, n_slots=n_slots, kv_dtype=np.float16)


def test_the_file_says_which_layers_attend(f32_path):
    cfg = family_for(GGUFFile(f32_path)).config
    assert [type(layer) for layer in cfg.layers] == [DeltaNet, Attention, DeltaNet, Attention]
    net, attn = cfg.layers[0], cfg.layers[1]
    assert (net.n_k_heads, net.n_v_heads, net.k_dim, net.v_dim, net.length, net.width) == (2, 4, 16, 8, 4, 96)
    assert attn.rope.dim == 4 and attn.rope.neox and attn.head_dim == 16


def test_oracle_matches_transformers(f32_path):
    assert rel_err(oracle(f32_path).forward(IDS, all_logits=True), hf_logits(f32_path, IDS)) < 1e-4


def test_oracle_greedy_text_is_transformers(f32_path):
    assert oracle_greedy(oracle(f32_path), IDS[:12], 16) == hf_greedy(f32_path, IDS[:12], 16)


def test_oracle_in_chunks_is_the_whole_prompt(f32_path):
    whole, parts = oracle(f32_path).forward(IDS, all_logits=True), oracle(f32_path)
    got = np.concatenate([parts.forward(IDS[a:b], 0, a, all_logits=True) for a, b in ((0, 13), (13, 14), (14, 40))])
    assert rel_err(got, whole) < 1e-5


def test_a_head_view_is_every_heads_part(f32_path):
    from kiln.gguf import head_view

    gguf = GGUFFile(f32_path)
    whole = gguf.dequantize("blk.1.attn_q.weight").reshape(4, 2, 16, 64)
    for part in (0, 1):
        assert np.array_equal(gguf.dequantize(head_view("blk.1.attn_q.weight", part, 2, 16)),
                              whole[:, part].reshape(64, 64))
    with pytest.raises(ModelFileError, match="not heads of 2 parts of 48 rows"):
        gguf.info(head_view("blk.1.attn_q.weight", 0, 2, 48))


@pytest.mark.parametrize("overrides,message", [
    ({"delta_net": (3, 4, 16, 8)}, "'qwen35.ssm.time_step_rank' is 4, expected a multiple of ssm.group_count"),
    ({"rope_sections": (2, 1, 0, 0)}, "'qwen35.rope.dimension_sections'.*summing to at most 2"),
])
def test_inconsistent_shapes_are_refused_naming_the_key(overrides, message, tmp_path):
    path = write_random_gguf(tmp_path / "bad.gguf", "tiny-qwen35", **overrides)
    with pytest.raises(ModelFileError, match=message):
        family_for(GGUFFile(path))


def test_multi_token_prediction_layers_are_refused(tmp_path):
    from kiln.errors import UnsupportedModelError

    path = write_random_gguf(tmp_path / "mtp.gguf", "tiny-qwen35", metadata=(("nextn_predict_layers", 1),))
    with pytest.raises(UnsupportedModelError, match="nextn_predict_layers"):
        family_for(GGUFFile(path))


# ---- the native plan -------------------------------------------------------------------------------------

def test_native_greedy_text_is_transformers(f32_path):
    native = engines(f32_path)[0]
    logits, out = native.forward(IDS[:12]), []
    for i in range(16):
        out.append(int(np.argmax(logits)))
        logits = native.forward([out[-1]], 0, 12 + i)
    assert out == hf_greedy(f32_path, IDS[:12], 16)


def test_float_model_matches_oracle_in_chunks_and_decode(f32_path, isa):
    # a small prefill plan, so a 40-token prompt runs as chunks of 17, 17 and 6
    native, oracle = engines(f32_path, prefill_rows=17, max_batch=4)
    assert rel_err(native.forward(IDS, all_logits=True), oracle.forward(IDS, all_logits=True)) < 1e-4
    for i, t in enumerate([7, 99, 300, 12, 45]):
        assert rel_err(native.forward([t], 0, 40 + i), oracle.forward([t], 0, 40 + i)) < 1e-4


def test_hidden_states_match_the_oracle_layer_by_layer(f32_path):
    native, oracle = engines(f32_path)
    got, want = native.hidden_states(IDS[:24]), oracle.hidden_states(IDS[:24])
    assert len(got) == len(want) == 2 * 4
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-4


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q8_0])
def test_quantized_model_is_close_to_oracle(qtype, tmp_path, isa):
    path = write_random_gguf(tmp_path / "q.gguf", "tiny-qwen35", qtype=qtype, seed=4)
    native, oracle = engines(path)
    a, b = native.forward(IDS, all_logits=True), oracle.forward(IDS, all_logits=True)
    assert kld(b, a).mean() < 0.01 and (a.argmax(-1) == b.argmax(-1)).mean() >= 0.9


def test_mixed_step_of_decode_rows_and_a_chunk(f32_path):
    native, oracle = engines(f32_path, n_slots=3)
    for engine in (native, oracle):
        engine.forward([5, 6, 7, 8], slot=0)
        engine.forward([9, 10], slot=1)
    tokens, slots, positions = [11, 12, 20, 21, 22, 23, 24], [0, 1, 2, 2, 2, 2, 2], [4, 2, 0, 1, 2, 3, 4]
    got, want = native.step(tokens, slots, positions, [0, 1, 6]), oracle.step(tokens, slots, positions, [0, 1, 6])
    assert rel_err(got, want) < 1e-4


def test_the_plan_checks_the_delta_nets_state_against_its_buffer(f32_path):
    from tests.test_plan import rebuild

    native = engines(f32_path)[0]
    rebuild(native)  # as handed: accepted
    state = memoryview(native.state_arena)
    # the last layer's matrices end the buffer: one cut short of them is refused, naming the field
    with pytest.raises(ValueError, match=r"plan op \d+ \(DELTANET, layer 2\): matrices needs \d+ bytes at byte \d+ "
                                         r"of buffer 'recurrent state'"):
        rebuild(native, **{"recurrent state": state[: len(state) - 4]})
