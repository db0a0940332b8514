"""A tiny Qwen-style tokenizer, built offline, for the families whose text encoder is a Qwen LLM.

Qwen-Image (Qwen2.5-VL), FLUX.2 [klein] and Z-Image (Qwen3) encode prompts with a Qwen tokenizer:
byte-level BPE, ``<|im_start|>``/``<|im_end|>`` chat markers, and a chat template that the pipelines
apply (``apply_chat_template``, with or without the ``<think>`` block) or write out themselves. The real
vocabulary has 151k entries and is not on PyPI, so this one is learnt here, deterministically, by the
``tokenizers`` BPE trainer on a small fixed corpus: the pipelines' prompt templates and common prompt
words. Every string still tokenizes (byte-level fallback), the templates become a few dozen tokens, and the
tokenizer saves and reloads as a plain ``Qwen2Tokenizer``.
"""

from __future__ import annotations


from transformers import Qwen2Tokenizer

from flowrl.models.tiny import _T5_WORDS, trained_byte_bpe_json

QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                       "<|vision_start|>", "<|vision_end|>", "<|image_pad|>")
# The Qwen3 chat template, reduced to what text-to-image pipelines use: user/system turns, the generation
# prompt, and the empty thinking block that ``enable_thinking=False`` adds.
QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
_CORPUS = (
    "Describe the image by detailing the color, shape, size, texture, quantity, text, spatial relationships "
    "of the objects and background:",
    "Describe the key features of the input image (color, shape, size, texture, objects, background), then "
    "explain how the user's text instruction should alter or modify the image.",
    "system user assistant " + " ".join(_T5_WORDS),
    "circle square triangle star left right top bottom moving edit make turn into",
)
TINY_QWEN_VOCAB = 700


def tiny_qwen_tokenizer(model_max_length: int = 1024) -> Qwen2Tokenizer:
    """A Qwen2 tokenizer (byte-level BPE, Qwen special tokens and chat template), same object every call."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(trained_byte_bpe_json(_CORPUS, TINY_QWEN_VOCAB, tuple(QWEN_SPECIAL_TOKENS)))
    tokenizer = Qwen2Tokenizer(tokenizer_object=backend, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                               unk_token=None, model_max_length=model_max_length)
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    return tokenizer
