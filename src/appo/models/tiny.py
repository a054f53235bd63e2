"""The `tiny-test` model: a deterministic random Llama-style model with a byte-level tokenizer.

Built in code (no files, no hub) in well under a second, for tests. The tokenizer is
byte-level BPE with no merges (every UTF-8 string round-trips exactly), the ChatML markers as
special tokens, and the tool / reasoning tags as single added tokens, so tests can script
tag boundaries precisely. The chat template (`CHATML_TOOLS_TEMPLATE`, written for appo) is
ChatML, like SmolLM2's, with Qwen-style tool support: `tools=` are listed in the system turn,
an assistant message's `tool_calls` render as `<tool_call>\n{"name": ..., "arguments": ...}\n
</tool_call>` blocks, and consecutive `tool` messages as `<tool_response>` blocks inside one
user turn (the layout of Qwen2.5 / Qwen3). Without tools it renders exactly as plain ChatML
(`CHATML_TEMPLATE`). The native-call tests (`tools.format=hermes`) run on it.
"""

from __future__ import annotations

import torch

TAGS = ("think", "python", "search", "result", "answer")
SPECIAL = ("<|im_start|>", "<|im_end|>", "<|pad|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The system turn's tool section (appo's own wording; Qwen-style layout).
_TOOLS_INTRO = (
    "# Tools\n\nYou can call the functions whose JSON schemas are listed in <tools></tools>:"
    "\n<tools>"
)
_TOOLS_OUTRO = (
    "\n</tools>\n\nTo call one, write <tool_call>\n{\"name\": FUNCTION, \"arguments\": "
    "{ARGUMENTS}}\n</tool_call> and end your turn; each result comes back inside "
    "<tool_response></tool_response>."
)
CHATML_TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] + '\n\n' }}"
    "{%- endif %}"
    "{{- '" + _TOOLS_INTRO + "' }}"
    "{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '" + _TOOLS_OUTRO.replace("'", "\\'") + "<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first and tools %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}"
    "{%- endif %}"
    "{{- '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{%- if message.content or not loop.first %}{{- '\n' }}{%- endif %}"
    "{{- '<tool_call>\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}"
    "{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}"
    "{{- '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)


def build_tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        additional_special_tokens=[],
    )
    tok.add_tokens([f"<{t}>" for t in TAGS] + [f"</{t}>" for t in TAGS])
    tok.chat_template = CHATML_TOOLS_TEMPLATE
    tok.model_max_length = 4096
    return tok


def tiny_config(vocab_size: int):
    """The tiny model's `LlamaConfig` (also what `appo plan` plans `tiny-test` from)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def build_tiny_model(vocab_size: int, seed: int = 0):
    from transformers import LlamaForCausalLM

    config = tiny_config(vocab_size)
    # A private RNG stream: building the test model must not disturb (or depend on) the
    # caller's global torch RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.eval()
    return model


def build_tiny(seed: int = 0):
    tok = build_tiny_tokenizer()
    model = build_tiny_model(len(tok), seed=seed)
    model.config.bos_token_id = tok.bos_token_id
    model.config.eos_token_id = tok.eos_token_id
    model.config.pad_token_id = tok.pad_token_id
    model.generation_config.bos_token_id = tok.bos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok
