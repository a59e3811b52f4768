"""`kiln eval kld` and `kiln eval ppl`: next-token distributions over a text, windowed like
llama-perplexity, with its statistics.

Windowing (llama-perplexity's): the text is tokenized once (with BOS when the model adds one) and cut
into non-overlapping windows of `ctx` tokens; a window's first token is replaced by BOS when the model
adds one, so every window starts the way a prompt does. Only the second half of each window is scored
(the logits at positions ctx/2 .. ctx-2 predicting tokens ctx/2+1 .. ctx-1, ctx/2-1 tokens a window):
the first half is context, so every scored token sees at least ctx/2 tokens of history and the scores
do not depend on how cold the start of a window is.

Streaming: each window is run through the candidate and the reference and reduced to per-token numbers
(NLLs, KLD, Δp, same top-1) before the next window; logits are never held for more than one window.

Statistics (llama-perplexity's `--kl-divergence` definitions): for per-token values x, mean ± sqrt(
(mean(x²) - mean(x)²) / (n-1)) (0 for n <= 10); PPL = exp(mean NLL) ± PPL·unc; ln(PPL(Q)/PPL(base))
± sqrt(u_q² + u_b² - 2·cov) where cov = (mean(nll·nll_base) - mean(nll)·mean(nll_base)) / (n-1) is
the covariance of the two means, and Cor(ln PPL(Q), ln PPL(base)) = cov / (u_q·u_b); KLD per token is
KL(base ‖ Q) = Σ p_base (ln p_base - ln q); Δp = q(token) - p_base(token), the change in the probability
of the actual next token; RMS Δp = sqrt(mean Δp²) ± unc(Δp²) / (2·RMS); same top-1 = f ± sqrt(f(1-f)/
(n-1)); percentiles interpolate linearly between sorted values (numpy's default, llama's too).

Saved references (`--save-reference PATH`, reused with `--reference-file PATH`): a zip (numpy .npz,
written window by window) holding meta.json, the windows' tokens, and per scored token the reference's
top-k token ids (int32) and log-probs (float32), the log-prob of the actual next token and the log of
the probability mass outside the top k (float64): 32 KiB a token for k = 4096, where llama-perplexity's
full-vocabulary uint16 log-probs take 2 bytes × vocabulary (96 KiB a token for SmolLM2, 512 KiB for
Gemma 3). From it NLL(base), Δp and same-top-1 are exact; KLD is computed over the top k plus one bin
for the rest, which by the data-processing inequality is a lower bound on the exact KLD. How close
depends on k and on where the engine errs: native kiln against the oracle on SmolLM2 over Moby-Dick
(4 windows of 512), k = 1024 recovers 70% of the exact KLD and 4096 87%, because the split output head
(csrc/op_logits.c) leaves its small errors on the logits far below the best (with the head whole, k = 1024
recovered 96% and 4096 99%). A live run computes KLD exactly.
"""

from __future__ import annotations

import json
import os
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kiln.errors import KilnError

TOP_K = 4096  # of a saved reference; see above for what k buys
FORMAT = "kiln-eval-reference"
FORMAT_VERSION = 1
BLOCK_ROWS = 32  # rows of logits converted to float64 at a time: Gemma's 262k vocabulary is 2 MiB a row


# ---- windows ----------------------------------------------------------------------------------------
def make_windows(tokens: list[int], ctx: int, chunks: int, bos_id: int | None) -> np.ndarray:
    """(n, ctx) int32 windows: `chunks` of them (0: as many as the text holds), BOS first when given."""
    if ctx < 4:
        raise KilnError(f"--ctx {ctx} is too small: a window needs context and at least one scored token")
    available = len(tokens) // ctx
    if available < 1:
        raise KilnError(f"the text is {len(tokens)} tokens, less than one window of --ctx {ctx}")
    n = available if chunks <= 0 else chunks
    if n > available:
        raise KilnError(f"--chunks {chunks} needs {chunks * ctx} tokens; the text has {len(tokens)} "
                        f"({available} windows of {ctx})")
    windows = np.asarray(tokens[: n * ctx], dtype=np.int32).reshape(n, ctx).copy()
    if bos_id is not None:
        windows[:, 0] = bos_id
    return windows


def text_windows(model, text: str, ctx: int, chunks: int) -> np.ndarray:
    tok = model.tokenizer
    if ctx > model.n_ctx:
        raise KilnError(f"--ctx {ctx} exceeds the context {model.n_ctx} that {model.tag} was loaded with")
    tokens = tok.encode(text, parse_special=False)  # a corpus is text: "<s>" in it is not a control token
    return make_windows(tokens, ctx, chunks, tok.bos_id if tok.add_bos else None)


# ---- scorers: (window, first) -> logits at positions first .. len(window)-2 -----------------------
class EngineScorer:
    """A kiln engine (native or oracle): the context half is prefilled without logits, then the scored
    half returns all its logits."""

    def __init__(self, engine, name: str):
        self.engine, self.name = engine, name

    def logits(self, window: np.ndarray, first: int) -> np.ndarray:
        window = [int(t) for t in window]
        self.engine.forward(window[:first], 0, 0)
        return self.engine.forward(window[first:-1], 0, first, all_logits=True)


class TransformersScorer:
    """transformers in float32 on the same GGUF file, an implementation independent of kiln's."""

    name = "transformers"

    def __init__(self, path: Path):
        try:
            import torch
            from transformers import AutoModelForCausalLM
            from transformers.utils import logging
        except ImportError as e:
            raise KilnError(f"--reference transformers needs torch and transformers installed ({e})") from None
        logging.set_verbosity_error()
        logging.disable_progress_bar()
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                          dtype=torch.float32).eval()

    def logits(self, window: np.ndarray, first: int) -> np.ndarray:
        with self.torch.no_grad():
            out = self.model(self.torch.tensor([window[:-1].astype(np.int64)])).logits[0]
        return out[first:].float().numpy()


# ---- per-token numbers ------------------------------------------------------------------------------
def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-ln p(target) per row, in float64."""
    out = np.empty(len(targets))
    for s in range(0, len(targets), BLOCK_ROWS):
        lp = log_softmax(logits[s : s + BLOCK_ROWS])
        out[s : s + BLOCK_ROWS] = -lp[np.arange(len(lp)), targets[s : s + BLOCK_ROWS]]
    return out


@dataclass
class Summary:
    """What a saved reference keeps of one window's distributions (see the module docstring)."""

    ids: np.ndarray  # (n, TOP_K) int32, most probable first
    logp: np.ndarray  # (n, TOP_K) float32
    target_logp: np.ndarray  # (n,) float64
    tail_logp: np.ndarray  # (n,) float64: ln of the probability outside the top-k


def summarize(logits: np.ndarray, targets: np.ndarray, k: int = TOP_K) -> Summary:
    n, k = len(targets), min(k, logits.shape[1])
    ids = np.empty((n, k), np.int32)
    logp = np.empty((n, k), np.float32)
    target, tail = np.empty(n), np.empty(n)
    for s in range(0, n, BLOCK_ROWS):
        lp = log_softmax(logits[s : s + BLOCK_ROWS])
        rows = np.arange(len(lp))[:, None]
        top = np.argpartition(-lp, k - 1, axis=1)[:, :k]
        top = np.take_along_axis(top, np.argsort(-lp[rows, top], axis=1, kind="stable"), axis=1)
        ids[s : s + len(lp)], logp[s : s + len(lp)] = top, lp[rows, top]
        target[s : s + len(lp)] = lp[rows[:, 0], targets[s : s + BLOCK_ROWS]]
        rest = np.exp(lp)
        rest[rows, top] = 0.0
        with np.errstate(divide="ignore"):  # nothing outside the top k: ln 0 = -inf, and p_tail = 0 below
            tail[s : s + len(lp)] = np.log(rest.sum(axis=1))
    return Summary(ids, logp, target, tail)


@dataclass
class TokenValues:
    nll: np.ndarray
    nll_base: np.ndarray
    kld: np.ndarray
    dp: np.ndarray
    same_top: np.ndarray


def compare_exact(cand: np.ndarray, ref: np.ndarray, targets: np.ndarray) -> TokenValues:
    parts = []
    for s in range(0, len(targets), BLOCK_ROWS):
        lq, lp = log_softmax(cand[s : s + BLOCK_ROWS]), log_softmax(ref[s : s + BLOCK_ROWS])
        rows, t = np.arange(len(lq)), targets[s : s + BLOCK_ROWS]
        kld = (np.exp(lp) * (lp - lq)).sum(axis=1)
        parts.append((-lq[rows, t], -lp[rows, t], kld, lq.argmax(axis=1) == lp.argmax(axis=1)))
    return _values(parts)


def compare_summary(cand: np.ndarray, ref: Summary, targets: np.ndarray) -> TokenValues:
    parts = []
    for s in range(0, len(targets), BLOCK_ROWS):
        e = s + BLOCK_ROWS
        lq = log_softmax(cand[s:e])
        rows, t = np.arange(len(lq)), targets[s:e]
        ids, lp = ref.ids[s:e], ref.logp[s:e].astype(np.float64)
        lq_top = np.take_along_axis(lq, ids, axis=1)
        q_rest = np.exp(lq)
        q_rest[rows[:, None], ids] = 0.0
        p_tail, tail = np.exp(ref.tail_logp[s:e]), np.zeros(len(lq))
        has = p_tail > 0
        with np.errstate(divide="ignore"):
            tail[has] = p_tail[has] * (ref.tail_logp[s:e][has] - np.log(q_rest[has].sum(axis=1)))
        kld = (np.exp(lp) * (lp - lq_top)).sum(axis=1) + tail
        parts.append((-lq[rows, t], -ref.target_logp[s:e], kld, lq.argmax(axis=1) == ids[:, 0]))
    return _values(parts)


def _values(parts) -> TokenValues:
    nll, nll_base, kld, same = (np.concatenate(c) for c in zip(*parts))
    return TokenValues(nll, nll_base, kld, np.exp(-nll) - np.exp(-nll_base), same)


# ---- statistics -------------------------------------------------------------------------------------
def mean_unc(x: np.ndarray) -> tuple[float, float]:
    """Mean and the uncertainty of the mean, as llama-perplexity computes them."""
    n = len(x)
    if n < 1:
        return 0.0, 0.0
    mean = float(np.mean(x))
    var = float(np.mean(x * x)) - mean * mean
    return mean, (var / (n - 1)) ** 0.5 if var > 0 and n > 10 else 0.0


def cov_of_means(a: np.ndarray, b: np.ndarray) -> float:
    n = len(a)
    if n < 10:
        return 0.0
    return (float(np.mean(a * b)) - float(np.mean(a)) * float(np.mean(b))) / (n - 1)


KLD_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0, 0.1)
DP_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 75.0, 50.0, 25.0, 10.0, 5.0, 1.0, 0.1)


def _pct_key(p: float) -> str:
    return "median" if p == 50.0 else f"p{p:g}"


def ppl_stats(nll: np.ndarray) -> dict:
    ln, unc = mean_unc(nll)
    ppl = float(np.exp(ln))
    return {"ppl": ppl, "ppl_unc": ppl * unc, "ln_ppl": ln, "ln_ppl_unc": unc, "tokens": int(len(nll))}


def kld_stats(v: TokenValues) -> dict:
    ln_q, u_q = mean_unc(v.nll)
    ln_b, u_b = mean_unc(v.nll_base)
    cov = cov_of_means(v.nll, v.nll_base)
    ppl_q, ppl_b = float(np.exp(ln_q)), float(np.exp(ln_b))
    ratio_ln, ratio_ln_unc = ln_q - ln_b, max(u_q * u_q + u_b * u_b - 2 * cov, 0.0) ** 0.5
    ratio = float(np.exp(ratio_ln))
    diff_unc = max((ppl_q * u_q) ** 2 + (ppl_b * u_b) ** 2 - 2 * ppl_q * ppl_b * cov, 0.0) ** 0.5
    kld, kld_unc = mean_unc(v.kld)
    dp, dp_unc = mean_unc(v.dp)
    mse, mse_unc = mean_unc(v.dp * v.dp)
    rms = mse**0.5
    same = float(np.mean(v.same_top))
    n = len(v.nll)
    return {
        "tokens": n,
        "ppl_q": ppl_q, "ppl_q_unc": ppl_q * u_q,
        "ppl_base": ppl_b, "ppl_base_unc": ppl_b * u_b,
        "cor_ln_ppl": cov / (u_q * u_b) if u_q > 0 and u_b > 0 else None,
        "ln_ppl_ratio": ratio_ln, "ln_ppl_ratio_unc": ratio_ln_unc,
        "ppl_ratio": ratio, "ppl_ratio_unc": ratio * ratio_ln_unc,
        "ppl_diff": ppl_q - ppl_b, "ppl_diff_unc": diff_unc,
        "kld_mean": kld, "kld_unc": kld_unc, "kld_max": float(v.kld.max()), "kld_min": float(v.kld.min()),
        **{f"kld_{_pct_key(p)}": float(np.percentile(v.kld, p)) for p in KLD_PERCENTILES},
        "dp_mean": dp, "dp_unc": dp_unc, "dp_max": float(v.dp.max()), "dp_min": float(v.dp.min()),
        **{f"dp_{_pct_key(p)}": float(np.percentile(v.dp, p)) for p in DP_PERCENTILES},
        "rms_dp": rms, "rms_dp_unc": 0.5 / rms * mse_unc if rms > 0 else 0.0,
        "same_top": same, "same_top_unc": (same * (1 - same) / (n - 1)) ** 0.5 if n > 1 else 0.0,
    }


def concat(values: list[TokenValues]) -> TokenValues:
    return TokenValues(*(np.concatenate([getattr(v, f) for v in values]) for f in
                         ("nll", "nll_base", "kld", "dp", "same_top")))


# ---- saved references -------------------------------------------------------------------------------
class ReferenceWriter:
    """Writes a reference file window by window; it appears at `path` only once complete."""

    def __init__(self, path: Path, meta: dict, windows: np.ndarray, top_k: int = TOP_K):
        self.path = Path(path)
        self.tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        self.zip = zipfile.ZipFile(self.tmp, "w", zipfile.ZIP_STORED)
        self.top_k = top_k
        meta = dict(meta, format=FORMAT, version=FORMAT_VERSION, top_k=top_k, windows=len(windows))
        self.zip.writestr("meta.json", json.dumps(meta, indent=1))
        self._array("tokens", windows)

    def _array(self, name: str, array: np.ndarray) -> None:
        with self.zip.open(f"{name}.npy", "w", force_zip64=True) as f:
            np.lib.format.write_array(f, np.ascontiguousarray(array))

    def add(self, index: int, s: Summary) -> None:
        for key in ("ids", "logp", "target_logp", "tail_logp"):
            self._array(f"w{index:05d}_{key}", getattr(s, key))

    def close(self, complete: bool) -> None:
        self.zip.close()
        if complete:
            os.replace(self.tmp, self.path)
        else:
            self.tmp.unlink(missing_ok=True)


class ReferenceFile:
    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self.npz = np.load(self.path)
            self.meta = json.loads(self.npz.zip.read("meta.json"))
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
            raise KilnError(f"{self.path}: not a kiln eval reference file ({e})") from None
        if self.meta.get("format") != FORMAT or self.meta.get("version") != FORMAT_VERSION:
            raise KilnError(f"{self.path}: format {self.meta.get('format')!r} version {self.meta.get('version')!r}; "
                            f"kiln reads {FORMAT!r} version {FORMAT_VERSION}")
        self.windows = self.npz["tokens"]

    def summary(self, index: int) -> Summary:
        try:
            return Summary(*(self.npz[f"w{index:05d}_{key}"] for key in ("ids", "logp", "target_logp", "tail_logp")))
        except KeyError:
            raise KilnError(f"{self.path}: window {index} is missing (the file is truncated)") from None


# ---- runs -------------------------------------------------------------------------------------------
@dataclass
class KLDRun:
    windows: np.ndarray
    candidate: EngineScorer
    reference: EngineScorer | TransformersScorer | None = None  # None: use reference_file
    reference_file: ReferenceFile | None = None
    save: ReferenceWriter | None = None
    progress: object = None  # callable(line) for the per-window table
    seconds: dict = field(default_factory=lambda: {"candidate": 0.0, "reference": 0.0})

    def run(self) -> tuple[dict, TokenValues]:
        ctx = self.windows.shape[1]
        first = ctx // 2
        values = []
        if self.progress:
            self.progress(f"{'window':>6} {'PPL(Q)':>20} {'ln(PPL(Q)/PPL(base))':>24} {'KLD':>22} "
                          f"{'RMS Δp %':>16} {'same top-1 %':>16}")
        for i, window in enumerate(self.windows):
            targets = window[first + 1 :].astype(np.int64)
            t0 = time.perf_counter()
            cand = self.candidate.logits(window, first)
            t1 = time.perf_counter()
            if self.reference_file is not None:
                v = compare_summary(cand, self.reference_file.summary(i), targets)
            else:
                ref = self.reference.logits(window, first)
                self.seconds["reference"] += time.perf_counter() - t1
                if self.save is not None:
                    self.save.add(i, summarize(ref, targets, self.save.top_k))
                v = compare_exact(cand, ref, targets)
                del ref
            self.seconds["candidate"] += t1 - t0
            values.append(v)
            if self.progress:
                self.progress(window_line(i + 1, kld_stats(concat(values))))
        all_values = concat(values)
        return kld_stats(all_values), all_values


def window_line(n: int, s: dict) -> str:
    return (f"{n:6d} {s['ppl_q']:10.4f} ± {s['ppl_q_unc']:7.4f} {s['ln_ppl_ratio']:11.5f} ± "
            f"{s['ln_ppl_ratio_unc']:9.5f} {s['kld_mean']:10.6f} ± {s['kld_unc']:9.6f} "
            f"{100 * s['rms_dp']:7.3f} ± {100 * s['rms_dp_unc']:6.3f} {100 * s['same_top']:7.3f} ± "
            f"{100 * s['same_top_unc']:6.3f}")


def perplexity(scorer, windows: np.ndarray, progress=None) -> tuple[dict, np.ndarray]:
    first = windows.shape[1] // 2
    nlls = []
    for i, window in enumerate(windows):
        nlls.append(token_nll(scorer.logits(window, first), window[first + 1 :].astype(np.int64)))
        if progress:
            s = ppl_stats(np.concatenate(nlls))
            progress(f"[{i + 1}] {s['ppl']:.4f} ± {s['ppl_unc']:.4f}")
    nll = np.concatenate(nlls)
    return ppl_stats(nll), nll


# ---- report -----------------------------------------------------------------------------------------
def format_kld(s: dict) -> str:
    def pm(key, width=10, digits=6):
        return f"{s[key]:{width}.{digits}f} ± {s[key + '_unc']:{width}.{digits}f}"

    cor = "n/a" if s["cor_ln_ppl"] is None else f"{100 * s['cor_ln_ppl']:6.2f}%"
    lines = [
        "====== Perplexity statistics ======",
        f"Mean PPL(Q)                   : {pm('ppl_q')}",
        f"Mean PPL(base)                : {pm('ppl_base')}",
        f"Cor(ln(PPL(Q)), ln(PPL(base))): {cor}",
        f"Mean ln(PPL(Q)/PPL(base))     : {pm('ln_ppl_ratio')}",
        f"Mean PPL(Q)/PPL(base)         : {pm('ppl_ratio')}",
        f"Mean PPL(Q)-PPL(base)         : {pm('ppl_diff')}",
        "",
        "====== KL divergence statistics ======",
        f"Mean    KLD: {s['kld_mean']:10.6f} ± {s['kld_unc']:10.6f}",
        f"Maximum KLD: {s['kld_max']:10.6f}",
    ]
    for p in KLD_PERCENTILES:
        label = "Median " if p == 50.0 else f"{p:4.1f}%  "
        lines.append(f"{label} KLD: {s['kld_' + _pct_key(p)]:10.6f}")
    lines.append(f"Minimum KLD: {s['kld_min']:10.6f}")
    lines += ["", "====== Token probability statistics ======",
              f"Mean    Δp: {100 * s['dp_mean']:6.3f} ± {100 * s['dp_unc']:5.3f} %",
              f"Maximum Δp: {100 * s['dp_max']:6.3f}%"]
    for p in DP_PERCENTILES:
        label = "Median " if p == 50.0 else f"{p:4.1f}%  "
        lines.append(f"{label} Δp: {100 * s['dp_' + _pct_key(p)]:6.3f}%")
    lines += [f"Minimum Δp: {100 * s['dp_min']:6.3f}%",
              f"RMS Δp    : {100 * s['rms_dp']:6.3f} ± {100 * s['rms_dp_unc']:5.3f} %",
              f"Same top p: {100 * s['same_top']:6.3f} ± {100 * s['same_top_unc']:5.3f} %"]
    return "\n".join(lines) + "\n"


def stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
