"""A tiny, randomly initialised FLUX.2 [dev] pipeline for offline tests.

Same component layout as ``black-forest-labs/FLUX.2-dev``: a ``Flux2Transformer2DModel`` with the guidance
embedding, an ``AutoencoderKLFlux2`` with seeded batch-norm statistics and FLUX.2's dynamically shifted scheduler
(all three shared with the klein tiny pipeline, :mod:`flowrl.models.tiny_flux2`), a
``Mistral3ForConditionalGeneration`` text encoder (Mistral text model plus a Pixtral vision tower) read at hidden
layers 10, 20 and 30 (so it keeps 30 layers, each only 16 wide), and a ``PixtralProcessor`` as the tokenizer.

The real processor wraps Mistral's 131k-token Tekken vocabulary, which is not on PyPI. This one wraps a byte-level
BPE learnt here, deterministically, on FLUX.2's system message and common prompt words, with Mistral's control
tokens (``[SYSTEM_PROMPT]``, ``[INST]``, ``[IMG]``...) and a chat template that lays out the pipeline's
system + user messages as Mistral Small's does. Every string still tokenizes (byte-level fallback), and the
processor saves and reloads with ``AutoProcessor``, so ``Flux2Pipeline.from_pretrained`` reloads it offline.
Weights are a pure function of ``seed`` (``flowrl.models.tiny._seeded``); everything float32, eval mode, CPU.
"""

from __future__ import annotations


from diffusers import Flux2Pipeline
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
from transformers import (
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    MistralConfig,
    PixtralImageProcessor,
    PixtralProcessor,
    PixtralVisionConfig,
    PreTrainedTokenizerFast,
)

from flowrl.models.tiny import _T5_WORDS, _seeded, trained_byte_bpe_json
from flowrl.models.tiny_flux2 import tiny_flux2_scheduler, tiny_flux2_transformer, tiny_flux2_vae

MISTRAL_HIDDEN = 16
MISTRAL_LAYERS = 30  # the pipeline reads hidden_states[10], [20], [30] by default
TEXT_OUT_LAYERS = (10, 20, 30)  # Flux2Pipeline's default text_encoder_out_layers
TINY_MISTRAL_VOCAB = 600
PATCH = 4  # the tiny vision tower's patch (real: 14); images never reach it in text-to-image
MISTRAL_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]",
                          "[/SYSTEM_PROMPT]", "[IMG]", "[IMG_BREAK]", "[IMG_END]")
# Mistral Small's chat template reduced to what Flux2Pipeline sends: a system turn and user turns whose content is
# a list of {"type": "text"} blocks (plain strings too), each wrapped in its control tokens, after the BOS token.
MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set text = message['content'] %}"
    "{%- else %}{%- set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text')"
    " | join('') %}{%- endif %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' + text + '[/INST]' }}"
    "{%- else %}{{- text + eos_token }}{%- endif %}"
    "{%- endfor %}"
)
_CORPUS = (SYSTEM_MESSAGE, " ".join(_T5_WORDS), "circle square triangle star left right top bottom")


def tiny_pixtral_processor() -> PixtralProcessor:
    """A ``PixtralProcessor`` around the tiny BPE tokenizer, with the Mistral chat template."""
    from tokenizers import Tokenizer

    bpe = trained_byte_bpe_json(_CORPUS, TINY_MISTRAL_VOCAB, tuple(MISTRAL_SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(bpe),
                                        bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
                                        model_max_length=1024)
    image_processor = PixtralImageProcessor(patch_size=PATCH, size={"longest_edge": 4 * PATCH})
    return PixtralProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH,
                            spatial_merge_size=2, chat_template=MISTRAL_CHAT_TEMPLATE)


def _mistral3(processor: PixtralProcessor) -> Mistral3ForConditionalGeneration:
    tokenizer = processor.tokenizer
    config = Mistral3Config(
        text_config=MistralConfig(
            vocab_size=len(tokenizer), hidden_size=MISTRAL_HIDDEN, intermediate_size=2 * MISTRAL_HIDDEN,
            num_hidden_layers=MISTRAL_LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
            max_position_embeddings=1024, rope_theta=1e9, sliding_window=None,  # as Mistral Small 3.x
            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        ),
        vision_config=PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, head_dim=8, patch_size=PATCH, image_size=4 * PATCH),
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2,
        tie_word_embeddings=False,  # untied, as Mistral Small 3.x
    )
    return Mistral3ForConditionalGeneration(config)


def tiny_flux2_dev_pipeline(seed: int = 0) -> Flux2Pipeline:
    """FLUX.2 [dev] layout with tiny random weights (Flux2Pipeline's default size is 1024 px: always pass
    height/width)."""
    processor = tiny_pixtral_processor()
    transformer = _seeded(seed, 0, lambda: tiny_flux2_transformer(
        guidance_embeds=True, text_dim=len(TEXT_OUT_LAYERS) * MISTRAL_HIDDEN))  # the stacked hidden states: 48
    vae = _seeded(seed, 1, tiny_flux2_vae)
    text_encoder = _seeded(seed, 2, lambda: _mistral3(processor))
    return Flux2Pipeline(scheduler=tiny_flux2_scheduler(), vae=vae, text_encoder=text_encoder, tokenizer=processor,
                         transformer=transformer)
