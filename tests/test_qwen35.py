"""Qwen3.5, the hybrid of Gated DeltaNet layers and gated full attention: against transformers (the
file's weights taken back through llama.cpp's conversion), and its state as a slot is fed, resumed and
copied."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from kiln.errors import ModelFileError
from kiln.gguf import GGUFFile
from kiln.models import family_for
from kiln.models.base import Attention, DeltaNet
from kiln.synth import write_random_gguf
from tests.reference import Builder, hf_greedy, hf_logits, oracle, oracle_greedy, register_builder, rel_err
from tests.test_lfm2 import engines

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

def test_the_plan_checks_the_delta_nets_state_against_its_buffer(f32_path):
    from tests.test_plan import rebuild

    native = engines(f32_path)[0]
    rebuild(native)  # as handed: accepted
    state = memoryview(native.state_arena)
    # the matrices' snapshots end the buffer, after the last layer's matrices: a buffer cut short of those
    # is refused, naming the field
    snapshots = 2 * 4 * 16 * 8 * 4
    with pytest.raises(ValueError, match=r"plan op \d+ \(DELTANET, layer 2\): matrices needs \d+ bytes at byte \d+ "
                                         r"of buffer 'recurrent state'"):
        rebuild(native, **{"recurrent state": state[: len(state) - snapshots - 4]})


@pytest.mark.parametrize("delta_net", [(2, 4, 14, 16), (2, 4, 16, 12)])
def test_the_state_update_matches_the_oracle_whatever_the_head_sizes(delta_net, tmp_path, isa):
    """14 key dimensions leave the vector update (csrc/delta_avx2.c) two rows past its passes of four; 12 value
    dimensions are no whole vectors, so they take the plain loops."""
    from tests.test_native import engines as native_and_oracle

    path = write_random_gguf(tmp_path / "q.gguf", "tiny-qwen35", qtype=QT.F32, seed=6, delta_net=delta_net)
    native, want = native_and_oracle(path, prefill_rows=7, max_batch=2)
    ids = [int(i) for i in np.random.default_rng(8).integers(3, 500, 20)]
    assert rel_err(native.forward(ids, all_logits=True), want.forward(ids, all_logits=True)) < 1e-4
    for i, t in enumerate([7, 99, 300]):
        assert rel_err(native.forward([t], 0, 20 + i), want.forward([t], 0, 20 + i)) < 1e-4


# ---- the slot's state: later turns, copied prefixes, speculation, the memory fit --------------------------

def greedy(tokens, n):
    from kiln.engine.sampler import SamplingParams
    from kiln.engine.sequence import Sequence
    from tests.test_scheduler import Letters

    return Sequence(list(tokens), SamplingParams.greedy(), Letters(), n)


def serve(engine, seqs):
    from kiln.engine.scheduler import Request, Scheduler
    from tests.test_scheduler import run_steps

    s = Scheduler(engine, n_slots=engine.n_slots, max_queue=8)
    for seq in seqs:
        s.submit(Request(seq, lambda event: None))
    run_steps(s)
    return s


def answer_alone(f32_path, prompt, n):
    """What a fresh engine answers: every prompt token prefilled."""
    seq = greedy(prompt, n)
    serve(engines(f32_path, prefill_rows=16, max_batch=4)[0], [seq])
    assert seq.timings.cached_tokens == 0
    return seq.output_ids


def test_a_slot_continues_only_where_it_stopped_or_from_its_snapshot(f32_path):
    from kiln.errors import KilnError

    native, fresh = engines(f32_path, prefill_rows=16, max_batch=4)[0], engines(f32_path)[0]
    assert native.state_positions.window == 0  # the matrices hold no history to rewind into
    native.forward(IDS[:30])
    assert native.resume_point(0, 30) == 30 and native.resume_point(0, 29) == 0
    with pytest.raises(KilnError, match="cannot continue at position 29"):
        native.forward(IDS[29:31], 0, 29)
    native.snapshot(0, 30)  # what the scheduler keeps at a prompt's end
    native.forward(IDS[30:] + [1] * 20, 0, 30)  # a reply runs on
    assert native.resume_point(0, 38) == 30
    again = native.forward(IDS[30:], 0, 30)  # from the snapshot: the same logits as a fresh prefill
    assert rel_err(again, fresh.forward(IDS)) < 1e-5
    native.forward(IDS[:12])  # a new prompt at 0 starts from zeros, whatever the slot held
    assert rel_err(native.forward(IDS[12:20], 0, 12), fresh.forward(IDS[:20])) < 1e-5


def test_later_turns_resume_from_the_state_or_the_prompts_snapshot(f32_path):
    from kiln.engine.scheduler import Request, Scheduler
    from tests.test_scheduler import run_steps

    native = engines(f32_path, prefill_rows=16, max_batch=4)[0]
    s = Scheduler(native, n_slots=1, max_queue=4)

    def turn(prompt, n):
        seq = greedy(prompt, n)
        s.submit(Request(seq, lambda event: None))
        run_steps(s)
        return seq

    first = turn(IDS[:20], 12)
    # a turn that extends the first prompt but not its reply resumes from the snapshot at the prompt's end
    branch = turn(IDS[:20] + [7, 8, 9], 8)
    assert branch.timings.cached_tokens == 20 and branch.output_ids == answer_alone(f32_path, branch.prompt_ids, 8)
    # one that extends all the slot holds continues where it stopped (the last sampled token never was fed)
    follow = turn(branch.prompt_ids + branch.output_ids + [33, 44, 55], 8)
    assert follow.timings.cached_tokens == 23 + 8 - 1
    assert follow.output_ids == answer_alone(f32_path, follow.prompt_ids, 8)
    # one that shares less than either starts over, with the same answer
    third = turn(IDS[:3] + [1] * 30, 4)
    assert third.timings.cached_tokens == 0 and third.output_ids == answer_alone(f32_path, third.prompt_ids, 4)
    assert first.output_ids == answer_alone(f32_path, IDS[:20], 12)


def test_a_running_requests_prompt_is_copied(f32_path):
    from kiln.engine.scheduler import Request, Scheduler
    from tests.test_scheduler import run_steps

    native = engines(f32_path, n_slots=2, prefill_rows=16, max_batch=4)[0]
    copies = []
    copy_slot = native.copy_slot
    native.copy_slot = lambda src, dst, n: (copies.append((src, dst, n)), copy_slot(src, dst, n))[1]
    s = Scheduler(native, n_slots=2, max_queue=4)
    a = greedy(IDS[:14], 10)
    s.submit(Request(a, lambda event: None))
    run_steps(s, 3)  # a's prompt is in and it decodes: its state is past the prompt, its snapshot at it
    b = greedy(IDS[:14] + [3, 4], 6)
    s.submit(Request(b, lambda event: None))
    run_steps(s)
    assert copies == [(0, 1, 14)] and b.timings.cached_tokens == 14
    assert b.output_ids == answer_alone(f32_path, b.prompt_ids, 6)
    assert a.output_ids == answer_alone(f32_path, a.prompt_ids, 10)


@pytest.fixture(scope="module")
def target_and_draft(tmp_path_factory):
    from kiln.engine.model import load
    from kiln.engine.speculative import ModelDrafter

    root = tmp_path_factory.mktemp("qwen35spec")
    target_path = write_random_gguf(root / "target.gguf", "tiny-qwen35", qtype=QT.Q8_0, seed=0)
    draft_path = write_random_gguf(root / "draft.gguf", "tiny-qwen35", qtype=QT.Q8_0, seed=7,
                                   tokenizer_from=target_path)
    target = load(str(target_path), backend="native", n_ctx=128, n_slots=2, progress=False)
    draft = load(str(draft_path), backend="native", n_ctx=128, n_slots=2, progress=False)
    yield target, ModelDrafter(draft, target)
    target.close()
    draft.close()


def test_speculation_with_rejections_gives_the_plain_greedy_output(target_and_draft):
    from kiln.engine.sampler import SamplingParams
    from kiln.engine.sequence import Sequence
    from kiln.engine.speculative import LookupDrafter, Speculation
    from tests.test_scheduler import Letters

    target, drafter = target_and_draft
    prompts = [[5, 6, 7, 8] * 6, IDS[:16]]
    plain = [greedy(p, 24) for p in prompts]
    serve(target.engine, plain)
    steps = []
    step = target.engine.step
    counts = []
    for make in (lambda: Speculation(LookupDrafter(4), 8), lambda: Speculation(drafter, 4)):
        seqs = [Sequence(list(p), SamplingParams.greedy(), Letters(), 24, speculation=make()) for p in prompts]
        target.engine.step = lambda *args: (steps.append((list(args[1]), list(args[2]))), step(*args))[1]
        serve(target.engine, seqs)
        target.engine.step = step
        assert [q.output_ids for q in seqs] == [q.output_ids for q in plain]
        counts.append((sum(q.timings.draft_tokens for q in seqs), sum(q.timings.draft_accepted for q in seqs)))
    (lookup_drafted, _), (model_drafted, model_accepted) = counts
    # another random model drafts: most of its tokens are rejected, and the target went back to the
    # draft's checkpoint, feeding the accepted tokens again (a step's positions go back)
    assert lookup_drafted > 0 and model_drafted > model_accepted
    def went_back(before, after):
        ends = {s: p for s, p in zip(*before)}  # each slot's last position in the earlier step
        return any(p <= ends.get(s, p - 1) for s, p in zip(*after))

    assert any(went_back(a, b) for a, b in zip(steps, steps[1:]))


def test_memory_fit_and_trace_count_the_recurrent_state(f32_path, tmp_path, monkeypatch):
    import math

    from kiln import trace
    from kiln import validate as V
    from kiln.engine.model import load

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    fp = V.footprint(str(f32_path), 128, n_slots=2)
    model = load(str(f32_path), backend="native", n_ctx=128, n_slots=2, threads=2, progress=False)
    e = model.engine
    width, matrices = 2 * 2 * 16 + 4 * 8, 4 * 16 * 8  # a DeltaNet's channels, and its matrices' floats
    ring = 4 - 1  # the taps before a row's own: no rewind
    # two DeltaNet layers: their rings, their matrices and the matrices' snapshot
    assert e.state_bytes_per_slot == 2 * 4 * (ring * width + 2 * matrices)
    assert e.state_arena.nbytes == 2 * e.state_bytes_per_slot
    huge = 2 ** 21
    assert fp["state_bytes"] == math.ceil(e.state_arena.nbytes / huge) * huge
    # per decode token: each DeltaNet reads the inputs its taps reach and its matrices, writes its input
    # and the matrices
    assert trace.state_bytes(e.decode_plan) == (2 * 4 * (ring * width + matrices), 2 * 4 * (width + matrices))
    model.close()


def test_the_template_switches_thinking(f32_path):
    from kiln.chat import render_chat
    from kiln.thinking import thinking_style

    template = GGUFFile(f32_path).metadata["tokenizer.chat_template"]
    style = thinking_style(template)
    assert (style.open, style.close, style.switch) == ("<think>", "</think>", "enable_thinking")
    messages = [{"role": "user", "content": "hi"}]
    assert render_chat(template, messages).endswith("<|im_start|>assistant\n<think>\n")
    assert render_chat(template, messages, enable_thinking=False).endswith("<think>\n\n</think>\n\n")


def test_kiln_run_answers_with_qwen35_on_the_native_engine(f32_path, capsys):
    from kiln.cli import main

    answers = []
    for backend in ("native", "oracle"):
        assert main(["run", str(f32_path), "hello there", "--backend", backend, "--temperature", "0", "-n", "8",
                     "-c", "128", "--verbose"]) == 0
        captured = capsys.readouterr()
        assert "(8 tokens)" in captured.err
        answers.append(captured.out)
    assert answers[0] == answers[1]
