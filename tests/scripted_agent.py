"""A scripted tool-calling model for the agent loop's tests: a tiny Qwen3 checkpoint whose next
token depends only on the current one (its layers add nothing to the residual stream; the LM head
reads a transition table off the one-hot embeddings), with a word-level tokenizer whose chat
template is Hermes/Qwen-style. After the generation prompt it emits one tool call, then its end
of turn, with probability ~1 at any temperature: every turn calls the calculator.
"""

import json
import os

import torch

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>'
PIECES = ["<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "tool", "system", "\n", CALL,
          "What", "is", "2", "3", "+", "5", "?"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MARGIN = 40.0  # the scripted token's logit over every other's


def _tokenizer(out_dir: str):
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    core = Tokenizer(models.WordLevel({piece: i for i, piece in enumerate(PIECES)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.decoder = decoders.Fuse()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>",
                                                     eos_token="<|im_end|>", pad_token="<unk>")
    tokenizer.add_tokens(["<|im_start|>", "<|im_end|>", "\n", CALL], special_tokens=False)
    tokenizer.add_special_tokens({"eos_token": "<|im_end|>"})
    ids = {piece: tokenizer.convert_tokens_to_ids(piece) for piece in PIECES}
    if ids != {piece: i for i, piece in enumerate(PIECES)}:
        raise RuntimeError(f"scripted tokenizer ids {ids} are not the pieces' order")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)


def make_scripted_agent(out_dir: str) -> str:
    import transformers

    os.makedirs(out_dir, exist_ok=True)
    _tokenizer(out_dir)
    ids = {piece: i for i, piece in enumerate(PIECES)}
    vocab, hidden = len(PIECES), 64
    config = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
        tie_word_embeddings=False, eos_token_id=ids["<|im_end|>"], bos_token_id=ids["<|im_end|>"],
        pad_token_id=0, architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    following = {ids["\n"]: ids[CALL]}  # everything else ends the turn
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * 0.02)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()  # the layers add nothing: the last hidden state is the token's embedding
            if "norm" in name:
                param.fill_(1.0)
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :vocab] = torch.eye(vocab)
        head = torch.zeros(vocab, hidden)
        for token in range(vocab):  # RMSNorm turns the one-hot into sqrt(hidden) times it
            head[following.get(token, ids["<|im_end|>"]), token] = MARGIN / hidden ** 0.5
        model.lm_head.weight.copy_(head)
    model.save_pretrained(out_dir, safe_serialization=True)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": ids["<|im_end|>"]}, f)
    return out_dir
