"""LFM2, the hybrid of gated short convolutions and attention: against transformers, the native plan
against the oracle, and every way a slot is reused or rewound with a recurrent state in it (a prompt
in chunks, a second turn, a copied prefix, rejected draft tokens, embeddings)."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from kiln.cli import main
from kiln.engine.model import load
from kiln.engine.sampler import SamplingParams
from kiln.engine.scheduler import Embedded, Request, Scheduler
from kiln.engine.sequence import Sequence
from kiln.engine.speculative import LookupDrafter, ModelDrafter, Speculation
from kiln.errors import KilnError, ModelFileError
from kiln.gguf import GGUFFile
from kiln.models import family_for
from kiln.models.base import Attention, ShortConv
from kiln.synth import write_random_gguf
from tests.reference import hf_logits, rel_err
from tests.test_native import engines as native_engines
from tests.test_scheduler import Letters, run_steps

IDS = [int(i) for i in np.random.default_rng(5).integers(3, 500, 40)]


@pytest.fixture(scope="module")
def f32_path(tmp_path_factory):
    return write_random_gguf(tmp_path_factory.mktemp("lfm2") / "lfm2.gguf", "tiny-lfm2", qtype=QT.F32, seed=11)


# test_native's pair of engines, with room for the state tests' longer prompts
engines = partial(native_engines, n_ctx=160)


def test_the_file_says_which_layers_attend(f32_path):
    cfg = family_for(GGUFFile(f32_path)).config
    assert [type(layer) for layer in cfg.layers] == [ShortConv, Attention, ShortConv, Attention]
    assert cfg.conv_length == 3 and cfg.layers[0] == ShortConv(64, 3)


@pytest.mark.parametrize("counts,message", [([2, 2, 1, 0], "one divisor"), ([0, 3, 0, 3], "one divisor"),
                                            ([0, 2, 0], "one per layer")])
def test_bad_per_layer_kv_heads_are_refused_naming_the_key(counts, message, tmp_path):
    import gguf

    path = write_random_gguf(tmp_path / "ok.gguf", "tiny-lfm2")
    bad = tmp_path / "bad.gguf"
    reader = gguf.GGUFReader(path)
    w = gguf.GGUFWriter(str(bad), "lfm2")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = counts if field.name == "lfm2.attention.head_count_kv" else field.contents()
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, value, field.types[0], sub)
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=list(reversed([int(d) for d in t.shape])),
                     raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match=f"'lfm2.attention.head_count_kv'.*{message}"):
        family_for(GGUFFile(bad))


def test_oracle_matches_transformers(f32_path):
    oracle = engines(f32_path)[1]
    assert rel_err(oracle.forward(IDS, all_logits=True), hf_logits(f32_path, IDS)) < 1e-4


def test_a_rewound_slot_continues_within_its_window_and_refuses_beyond(f32_path):
    native, _ = engines(f32_path, prefill_rows=16, max_batch=4)
    window = native.state_positions.window
    native.forward(IDS)
    again = native.forward(IDS[30:], 0, 30)  # rewound by 10: the state still reaches back there
    assert rel_err(again, engines(f32_path)[0].forward(IDS)) < 1e-5
    assert native.resume_point(0, len(IDS) - window) == len(IDS) - window
    assert native.resume_point(0, len(IDS) - window - 1) == 0  # no snapshot: it starts over
    with pytest.raises(KilnError, match="cannot continue at position 3"):
        native.forward(IDS[3:6], 0, 3)
    native.snapshot(0, len(IDS) - 2)  # what the scheduler keeps at a prompt's end
    native.forward(IDS[38:] + [1] * 30, 0, 38)  # runs on past the window
    assert native.resume_point(0, 39) == 38  # the snapshot is the furthest point it still reaches before 39
    again = native.forward(IDS[38:], 0, 38)
    assert rel_err(again, engines(f32_path)[0].forward(IDS)) < 1e-5


def greedy(tokens, n):
    return Sequence(list(tokens), SamplingParams.greedy(), Letters(), n)


def serve(engine, seqs):
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


def test_later_turns_resume_from_the_state_or_the_prompts_snapshot(f32_path):
    native = engines(f32_path, prefill_rows=16, max_batch=4)[0]
    s = Scheduler(native, n_slots=1, max_queue=4)

    def turn(prompt, n):
        seq = greedy(prompt, n)
        s.submit(Request(seq, lambda event: None))
        run_steps(s)
        return seq

    first = turn(IDS[:20], 24)
    # a turn that extends the first prompt but not its reply: the reply ran past the window, so the rings no
    # longer reach back to the prompt's end, and it resumes from the snapshot kept there
    assert native.state_positions.window < 24
    branch = turn(IDS[:20] + [7, 8, 9], 8)
    assert branch.timings.cached_tokens == 20 and branch.output_ids == answer_alone(f32_path, branch.prompt_ids, 8)
    # a turn that extends all the slot holds continues from the rings (the last sampled token never was fed)
    follow = turn(branch.prompt_ids + branch.output_ids + [33, 44, 55], 8)
    assert follow.timings.cached_tokens == 23 + 8 - 1
    assert follow.output_ids == answer_alone(f32_path, follow.prompt_ids, 8)
    # one that shares less than either reaches starts over, with the same answer
    third = turn(IDS[:3] + [1] * 30, 4)
    assert third.timings.cached_tokens == 0 and third.output_ids == answer_alone(f32_path, third.prompt_ids, 4)
    assert first.output_ids == answer_alone(f32_path, IDS[:20], 24)


def test_a_running_requests_prefix_is_copied(f32_path):
    native = engines(f32_path, n_slots=2, prefill_rows=16, max_batch=4)[0]
    copies = []
    copy_slot = native.copy_slot
    native.copy_slot = lambda src, dst, n: (copies.append((src, dst, n)), copy_slot(src, dst, n))[1]
    s = Scheduler(native, n_slots=2, max_queue=4)
    a = greedy(IDS[:12] + [1, 2], 10)
    s.submit(Request(a, lambda event: None))
    run_steps(s, 2)  # a's prompt is in, its first tokens decoded
    b = greedy(IDS[:12] + [3], 6)
    s.submit(Request(b, lambda event: None))
    run_steps(s)
    assert copies == [(0, 1, 12)] and b.timings.cached_tokens == 12
    assert b.output_ids == answer_alone(f32_path, b.prompt_ids, 6)


@pytest.fixture(scope="module")
def target_and_draft(tmp_path_factory):
    root = tmp_path_factory.mktemp("lfm2spec")
    target_path = write_random_gguf(root / "target.gguf", "tiny-lfm2", qtype=QT.Q8_0, seed=0)
    draft_path = write_random_gguf(root / "draft.gguf", "tiny-lfm2", qtype=QT.Q8_0, seed=7,
                                   tokenizer_from=target_path)
    target = load(str(target_path), backend="native", n_ctx=128, n_slots=2, progress=False)
    draft = load(str(draft_path), backend="native", n_ctx=128, n_slots=2, progress=False)
    yield target, ModelDrafter(draft, target)
    target.close()
    draft.close()


def test_speculation_with_rejections_gives_the_plain_greedy_output(target_and_draft):
    target, drafter = target_and_draft
    prompts = [[5, 6, 7, 8] * 6, IDS[:16]]
    plain = [greedy(p, 24) for p in prompts]
    serve(target.engine, plain)
    counts = []
    for make in (lambda: Speculation(LookupDrafter(4), 8), lambda: Speculation(drafter, 4)):
        seqs = [Sequence(list(p), SamplingParams.greedy(), Letters(), 24, speculation=make()) for p in prompts]
        serve(target.engine, seqs)
        assert [q.output_ids for q in seqs] == [q.output_ids for q in plain]
        counts.append((sum(q.timings.draft_tokens for q in seqs), sum(q.timings.draft_accepted for q in seqs)))
    (lookup_drafted, _), (model_drafted, model_accepted) = counts
    # another random model drafts: most of its tokens are rejected, and the target's state rewound past them
    assert lookup_drafted > 0 and model_drafted > model_accepted


def test_embedding_is_the_final_hidden_state(f32_path):
    native, oracle = engines(f32_path, n_slots=2)
    got = []
    s = Scheduler(native, n_slots=2, max_queue=4)
    s.submit(Request(greedy(IDS[:20], 1), lambda e: got.append(e.vector) if isinstance(e, Embedded) else None,
                     embed=True))
    run_steps(s)
    oracle.forward(IDS[:20])
    assert rel_err(got[0], oracle.last_final[0]) < 1e-4


def test_kiln_run_answers_with_lfm2_on_the_native_engine(f32_path, capsys):
    answers = []
    for backend in ("native", "oracle"):
        assert main(["run", str(f32_path), "hello there", "--backend", backend, "--temperature", "0", "-n", "8",
                     "-c", "128", "--verbose"]) == 0
        captured = capsys.readouterr()
        assert "(8 tokens)" in captured.err
        answers.append(captured.out)
    assert answers[0] == answers[1]


def test_memory_fit_and_trace_count_the_recurrent_state(f32_path, tmp_path, monkeypatch):
    import math

    from kiln import trace
    from kiln import validate as V

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    fp = V.footprint(str(f32_path), 128, n_slots=2)
    model = load(str(f32_path), backend="native", n_ctx=128, n_slots=2, threads=2, progress=False)
    e = model.engine
    ring = e.limits.rows + 3 - 1  # a step's rows behind the furthest position, and the taps before it
    assert e.state_bytes_per_slot == 2 * ring * 64 * 4 and e.state_arena.nbytes == 2 * e.state_bytes_per_slot
    assert e.kv_arena.nbytes == 2 * 2 * 2 * 2 * 128 * 2 * 16  # fp16 K and V of the 2 attention layers only
    huge = 2 ** 21
    assert fp["state_bytes"] == math.ceil(e.state_arena.nbytes / huge) * huge
    assert fp["kv_bytes"] == math.ceil(e.kv_arena.nbytes / huge) * huge
    assert fp["total_bytes"] == fp["weights_bytes"] + fp["kv_bytes"] + fp["state_bytes"] + fp["working_bytes_estimate"]
    # per decode token: two convolutions read their two earlier inputs and write their own
    assert trace.state_bytes(e.decode_plan) == (2 * 2 * 64 * 4, 2 * 64 * 4)
    figures = trace.dispatch_figures(e)
    assert figures["state_read_bytes"] == 2 * 2 * 64 * 4 and figures["state_write_bytes"] == 2 * 64 * 4
    model.close()
