"""A model file that writes one scripted reply: a bigram model whose greedy (and near-greedy) next token
after each token of the script is the script's next one, so thinking models' output can be tested
through the real engine and server. Its chat template is the test's fixture."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from kiln.tokenizer import bytes_to_unicode

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # control tokens; <|im_end|> ends the reply
MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]  # user-defined, as Qwen3's files have them
DIM, FFN, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 4, 2, 16


def write_scripted_gguf(path: str | Path, template: str, script: list[str], after: str = "\n",
                        specials: list[str] = SPECIALS, markers: list[str] = MARKERS, end: str = "<|im_end|>") -> Path:
    """A model whose reply to any prompt ending in the text `after` (one byte) is `script`, piece by
    piece (each piece one token, none repeated), then `end` (one of the control tokens `specials`, the
    file's end-of-sequence token). `markers` are user-defined tokens."""
    byte_chars = bytes_to_unicode()
    spell = lambda text: "".join(byte_chars[b] for b in text.encode())  # noqa: E731 - GPT-2's byte alphabet
    tokens = specials + markers + list(byte_chars.values()) + [spell(" t")]  # a BPE file needs a merge
    types = [3] * len(specials) + [4] * len(markers) + [1] * 257
    ids = {}
    for piece in script:
        name = piece if piece in markers or piece in specials else spell(piece)
        if name not in tokens:
            tokens.append(name)
            types.append(1)
        ids[piece] = tokens.index(name)
    chain = [tokens.index(spell(after))] + [ids[p] for p in script] + [specials.index(end)]
    assert len(set(chain[:-1])) == len(chain) - 1 <= DIM, "each token of the script leads to one next token"
    vocab = len(tokens)
    embed, output = np.zeros((vocab, DIM), np.float32), np.zeros((vocab, DIM), np.float32)
    for k, (token, following) in enumerate(zip(chain, chain[1:])):
        embed[token, k] = 1.0
        output[following, k] = 10.0  # after RMS norm: a logit of 80 for the next token, 0 for the rest
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("scripted llama")
    w.add_context_length(2048)
    w.add_embedding_length(DIM)
    w.add_block_count(1)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_merges([f"{spell(' ')} t"])
    w.add_token_types(types)
    w.add_bos_token_id(0)
    w.add_eos_token_id(specials.index(end))
    w.add_add_bos_token(False)
    w.add_chat_template(template)
    small = lambda *shape: (rng.standard_normal(shape) * 0.1).astype(np.float32)  # noqa: E731
    w.add_tensor("token_embd.weight", embed)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(DIM, np.float32))
    w.add_tensor("blk.0.attn_q.weight", small(HEADS * HEAD_DIM, DIM))
    w.add_tensor("blk.0.attn_k.weight", small(KV_HEADS * HEAD_DIM, DIM))
    w.add_tensor("blk.0.attn_v.weight", small(KV_HEADS * HEAD_DIM, DIM))
    # The layer adds nothing to the residual stream: the next token depends on the last one alone.
    w.add_tensor("blk.0.attn_output.weight", np.zeros((DIM, HEADS * HEAD_DIM), np.float32))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(DIM, np.float32))
    w.add_tensor("blk.0.ffn_gate.weight", small(FFN, DIM))
    w.add_tensor("blk.0.ffn_up.weight", small(FFN, DIM))
    w.add_tensor("blk.0.ffn_down.weight", np.zeros((DIM, FFN), np.float32))
    w.add_tensor("output_norm.weight", np.ones(DIM, np.float32))
    w.add_tensor("output.weight", output)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
