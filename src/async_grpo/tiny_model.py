"""A tiny byte-level Qwen2 model and tokenizer, built locally so tests and the CPU demo need no hub access.

The tokenizer is transformers' own `Qwen2Tokenizer` (a `tokenizers` byte-level BPE) with no merges, so
every byte is one token (id == byte value), decode(encode(s)) == s for any UTF-8 string, and
`AutoTokenizer` (which forces `Qwen2Tokenizer` for model_type qwen2) rebuilds exactly the same thing.
A stock `Qwen2ForCausalLM` with head dim 32 (supported by vLLM's CPU attention) means the trainer, vLLM
and weight sync exercise the code paths a real Qwen model would.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)  # ids 256, 257, 258
VOCAB_MULTIPLE = 64
HEAD_DIM = 32
# ChatML. With `tools`, a compact system turn lists them as `name(arg, ...)` (one line each: the byte-level model
# has 512 positions); an assistant turn writes each call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
# after its content, and a tool result is a `tool` turn. A conversation without tools and tool calls renders
# byte-identically to the original one-line template, so prompts and models built before are unchanged.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\ntools:' }}"
    "{% for tool in tools %}{% set fn = tool['function'] if tool['function'] is defined else tool %}"
    "{{ ' ' + fn['name'] + '(' + (fn['parameters']['properties'] | list | join(', ')) + ')' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "{% set fn = call['function'] if call['function'] is defined else call %}"
    "{% set args = fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson) %}"
    "{{ '<tool_call>{\"name\": ' + (fn['name'] | tojson) + ', \"arguments\": ' + args + '}</tool_call>' }}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# How transformers' `parse_response` reads an assistant turn of this template (saved in tokenizer_config.json).
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}
_MARKER_FILE = "tiny_model.json"
# Bump when the files this module writes change, so `ensure_tiny_model` rebuilds stale folders.
BUILD_VERSION = 3
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", _MARKER_FILE)


def build_tiny_tokenizer():
    """Build the byte-level tokenizer as a transformers `Qwen2Tokenizer` (no file I/O).

    Vocabulary: the 256 byte-level symbols (token id == byte value, so `a` is 97 and a space is 32),
    then the special tokens `<|endoftext|>` (256; eos and pad), `<|im_start|>` (257) and `<|im_end|>`
    (258). There are no merges, so every byte of the UTF-8 text is one token and decoding is exact
    (spaces, newlines and non-ASCII included). `encode` adds no BOS/EOS. A ChatML `chat_template` is
    set; an assistant turn ends with `<|im_end|>`.

    Returns:
        transformers.Qwen2Tokenizer (a `PreTrainedTokenizerFast`/`TokenizersBackend`).
    """
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    vocab = {symbol: byte for byte, symbol in bytes_to_unicode().items()}
    vocab.update({tok: 256 + i for i, tok in enumerate(SPECIAL_TOKENS)})
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=None,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
        response_template=RESPONSE_TEMPLATE,
        model_max_length=512,
    )


def _padded_vocab_size(n_tokens: int) -> int:
    return -(-n_tokens // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def _tiny_config(
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
    tie_word_embeddings: bool,
    **extra: object,
):
    """The `Qwen2Config` of a tiny byte-level model (sizes checked; eos is pad). Raises ValueError on bad sizes."""
    if hidden_size != num_heads * HEAD_DIM:
        raise ValueError(
            f"hidden_size={hidden_size} with num_heads={num_heads} gives head dim {hidden_size / num_heads:g}, "
            f"but the tiny model needs head dim {HEAD_DIM} (vLLM's CPU attention supports 32/64/80/...). "
            f"Fix: set hidden_size = num_heads x {HEAD_DIM}."
        )
    if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}. Fix: use e.g. 1 or 2.")
    for name, value in (
        ("num_layers", num_layers),
        ("intermediate_size", intermediate_size),
        ("max_position_embeddings", max_position_embeddings),
    ):
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1. Fix: pass a positive value.")
    from transformers import Qwen2Config

    tokenizer = build_tiny_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    return Qwen2Config(
        vocab_size=_padded_vocab_size(len(tokenizer)),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        dtype="float32",
        **extra,
    )


def build_tiny_model(
    out_dir: str | os.PathLike,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 384,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
) -> Path:
    """Write a randomly initialised byte-level `Qwen2ForCausalLM` and its tokenizer into `out_dir`.

    Files: config.json, model.safetensors (float32), generation_config.json (eos ids are both
    `<|endoftext|>` and `<|im_end|>`, so plain and chat completions both stop), tokenizer.json,
    tokenizer_config.json, chat_template.jinja and a `tiny_model.json` marker with the build args.
    The 259-token vocabulary is padded to 320 (a multiple of 64). The embeddings are untied by default
    (`tie_word_embeddings=True` ties them, as Qwen2.5-0.5B/1.5B do; the gloo weight push re-ties vLLM's LM head,
    `transports.weights.gloo.retie_lm_head`). With the defaults the model has about 0.48M parameters. Same seed and
    arguments -> identical weights.

    Args:
        out_dir: folder to write (created; existing files are overwritten).
        seed: torch seed for the weight initialisation.
        hidden_size: model width; must equal num_heads x 32 (head dim 32 for vLLM's CPU attention).
        num_layers, num_heads, num_kv_heads, intermediate_size, max_position_embeddings, tie_word_embeddings:
            Qwen2Config fields of the same meaning (num_kv_heads must divide num_heads).

    Returns:
        The output folder as a Path.

    Raises:
        ValueError: inconsistent sizes; the message names the argument and the fix.
    """
    config = _tiny_config(
        hidden_size,
        num_layers,
        num_heads,
        num_kv_heads,
        intermediate_size,
        max_position_embeddings,
        tie_word_embeddings,
    )

    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    im_end_id = tokenizer.convert_tokens_to_ids(IM_END_TOKEN)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=[eos_id, im_end_id], pad_token_id=eos_id, bos_token_id=None)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    marker = {
        "build_version": BUILD_VERSION,
        "seed": seed,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
    }
    # Written last: its presence means the folder is complete (see is_tiny_model_dir).
    (out / _MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    return out


def build_tiny_reward_model(
    out_dir: str | os.PathLike,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 1,
    num_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
) -> Path:
    """Write a randomly initialised byte-level `Qwen2ForSequenceClassification` with one label (a reward model, as
    TRL's RewardTrainer saves one) and the policy's tokenizer (eos as pad, the ChatML template) into `out_dir`.

    The head reads the last non-pad token, so its single logit is the reward (`rewards.reward_model`). Train it
    with `rewards.pairwise.train_reward_model_on_pairs`. Same seed and arguments -> identical weights.

    Returns:
        The output folder as a Path.

    Raises:
        ValueError: inconsistent sizes (as `build_tiny_model`).
    """
    config = _tiny_config(
        hidden_size,
        num_layers,
        num_heads,
        1,
        intermediate_size,
        max_position_embeddings,
        False,
        num_labels=1,
        architectures=["Qwen2ForSequenceClassification"],
    )
    import torch
    from transformers import Qwen2ForSequenceClassification

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForSequenceClassification(config).to(torch.float32)
    model.save_pretrained(out)
    build_tiny_tokenizer().save_pretrained(out)
    return out


def is_tiny_model_dir(path: str | os.PathLike) -> bool:
    """True when `path` holds a complete tiny model written by this version of `build_tiny_model`.

    The `tiny_model.json` marker is written last and records BUILD_VERSION, so an interrupted or
    outdated build reads as False.
    """
    p = Path(path)
    if not (p.is_dir() and all((p / name).is_file() for name in _REQUIRED_FILES)):
        return False
    try:
        return json.loads((p / _MARKER_FILE).read_text()).get("build_version") == BUILD_VERSION
    except (OSError, ValueError, AttributeError):
        return False


def ensure_tiny_model(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Build the tiny model into `out_dir` unless a complete one is already there; safe to re-run.

    An existing complete, current folder is reused whatever seed it was built with (its
    `tiny_model.json` records it); delete the folder to rebuild. An outdated one is rebuilt in place. A missing folder is built in a temporary sibling and
    renamed into place, so concurrent callers never see a half-written model.

    Returns:
        The folder as a Path.
    """
    out = Path(out_dir)
    if is_tiny_model_dir(out):
        return out
    if out.exists():  # an incomplete or outdated folder: rebuild it in place
        return build_tiny_model(out, seed=seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        build_tiny_model(tmp, seed=seed)
        try:
            tmp.chmod(0o755)  # mkdtemp creates it owner-only
            tmp.rename(out)
        except OSError:  # another process renamed first
            if not is_tiny_model_dir(out):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
