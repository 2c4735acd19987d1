"""The byte-level tokenizer shipped with ulysses-sp, built in code (nothing downloaded).

Token ``i`` for ``i < 256`` is the byte ``i``; three special tokens follow: ``<pad>`` (256),
``<bos>`` (257), ``<eos>`` (258). Any text round-trips (UTF-8 bytes), so it serves both the
embedded ``recall`` task and a user's local text files. It is a real
``transformers.PreTrainedTokenizerFast`` (a ``tokenizers`` BPE model with no merges over the GPT-2
byte alphabet), so ``save_pretrained`` writes standard files and ``AutoTokenizer.from_pretrained``
loads them back offline, without ulysses-sp installed.
"""

from __future__ import annotations

from functools import lru_cache

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

NUM_BYTES = 256
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<bos>", "<eos>"
PAD_ID, BOS_ID, EOS_ID = NUM_BYTES, NUM_BYTES + 1, NUM_BYTES + 2
VOCAB_SIZE = NUM_BYTES + 3


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> tuple[str, ...]:
    """GPT-2's reversible byte -> printable-unicode map (what ``pre_tokenizers.ByteLevel`` emits)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    )
    chars = {}
    extra = 0
    for b in range(NUM_BYTES):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(NUM_BYTES + extra)
            extra += 1
    return tuple(chars[b] for b in range(NUM_BYTES))


def byte_tokenizer(model_max_length: int = 1 << 20) -> PreTrainedTokenizerFast:
    """Build the byte-level tokenizer (vocab 259: 256 bytes + ``<pad>``, ``<bos>``, ``<eos>``).

    ``encode`` adds no special tokens by itself; the data pipelines place ``<bos>``/``<eos>``.
    """
    vocab = {ch: i for i, ch in enumerate(_bytes_to_unicode())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: one pre-token per input, so no byte is treated specially.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([PAD_TOKEN, BOS_TOKEN, EOS_TOKEN])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        model_max_length=model_max_length,
    )
    assert (fast.pad_token_id, fast.bos_token_id, fast.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    return fast
