"""A discriminative reward model, `rm:PATH`: an HF *ForSequenceClassification checkpoint with one
label (Skywork-Reward style) scored on the training ranks through Megatron, as the value model
(GPTModel trunk + ValueHead, its `score.weight` the head) at the training layout.

Owns what the reward model reads and which output is the score. A sequence's score is the head's
output at its last token that is not the config's pad_token_id, as HF's sequence classification
pools it (a response ending in an EOS that is also the pad token is scored before it).

What it reads: with the policy's tokenizer (the folder holds none, or the same vocabulary and chat
template), the exact prompt and response token ids the policy saw; with a tokenizer of its own, the
prompt's chat messages and the decoded response rendered by its own chat template (as verl
re-renders for a reward model of another family). Held in memory for the whole run, forward only.
"""

from functools import partial
from typing import List

import torch
import transformers

from megarl.actor.config import BatchingConfig
from megarl.actor.passes import local_micro_batches
from megarl.actor.schedule import forward_only_result, full_pack, run_micro_batches, share_rows
from megarl.batch.rollout_batch import RolloutBatch
from megarl.models.hf.config import load_hf_config, reward_model_arch
from megarl.models.hf.safetensors_reader import SafetensorsReader
from megarl.models.hf.tokenizer_files import has_tokenizer
from megarl.models.hf.weights_io import load_hf_weights
from megarl.models.megatron.builder import build_model
from megarl.models.weights import tables as weight_tables
from megarl.parallel_state import megatron_groups
from megarl.parallel_state.dims import ParallelDims
from megarl.rewards.functions import Request


def _same_tokenizer(mine, policy) -> bool:
    return (mine.get_vocab() == policy.get_vocab()
            and getattr(mine, "chat_template", None) == getattr(policy, "chat_template", None))


class RewardModel:
    def __init__(self, path: str, dims: ParallelDims, batching: BatchingConfig, policy_tokenizer,
                 **transformer_overrides):
        self.path, self.batching = path, batching
        hf_config = load_hf_config(path)
        self.arch = reward_model_arch(hf_config, path)
        self.pad = hf_config.get("pad_token_id")
        reader = SafetensorsReader(path)
        try:
            if weight_tables.VALUE_HEAD.hf[0] not in reader.names():
                raise ValueError(f"reward model {path!r} has no {weight_tables.VALUE_HEAD.hf[0]!r} tensor "
                                 "(the score head): save it with save_pretrained of its "
                                 "*ForSequenceClassification class")
        finally:
            reader.close()
        self.chunks = build_model(self.arch, dims, role="value", perform_initialization=False,
                                  **transformer_overrides)
        load_hf_weights(self.chunks, self.arch, path, role="value")
        for chunk in self.chunks:
            chunk.eval()
        self.tokenizer = None  # the policy's: its token ids are read as they are
        if has_tokenizer(path):
            own = transformers.AutoTokenizer.from_pretrained(path)
            if policy_tokenizer is None or not _same_tokenizer(own, policy_tokenizer):
                self.tokenizer = own

    def _tokens(self, request: Request, policy_ids: List[int]) -> List[int]:
        tokens = self._rendered(request, policy_ids)
        while len(tokens) > 1 and tokens[-1] == self.pad:
            tokens.pop()  # HF pools at the last token that is not padding
        return tokens

    def _rendered(self, request: Request, policy_ids: List[int]) -> List[int]:
        if self.tokenizer is None:
            return list(policy_ids)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"reward model {self.path!r} has a tokenizer of its own without a chat "
                             "template, so megarl cannot render the conversation for it; give its "
                             "folder a chat template, or the policy's tokenizer files")
        turns = [*request.messages, {"role": "assistant", "content": request.response}]
        text = self.tokenizer.apply_chat_template(turns, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _report(self, mb, output):
        # output [1, t/cp, 1]: the score of each sequence is the head's output at its last token
        full = full_pack(output[0, :, 0].float(), mb)
        last = (mb.cu_seqlens_padded[:-1].long() + mb.lengths - 1).to(full.device)
        return forward_only_result(output, scores=full[last][:, None])

    @torch.no_grad()
    def __call__(self, requests: List[Request], token_ids: List[List[int]]) -> torch.Tensor:
        """[n] float32 scores. Collective over the training ranks."""
        rows = [self._tokens(r, ids) for r, ids in zip(requests, token_ids)]
        longest = max(len(r) for r in rows)
        if longest > self.arch.max_position_embeddings:
            raise ValueError(f"a sequence of {longest} tokens is longer than reward model {self.path!r} "
                             f"reads (max_position_embeddings={self.arch.max_position_embeddings}); "
                             "shorten data.max_prompt_len + generation.max_new_tokens")
        n = len(rows)
        tokens = torch.zeros((n, longest), dtype=torch.long)
        for i, row in enumerate(rows):
            tokens[i, :len(row)] = torch.tensor(row)
        lengths = torch.tensor([len(r) for r in rows])
        batch = RolloutBatch(tokens=tokens, lengths=lengths, loss_mask=torch.zeros(n, longest),
                             group_ids=torch.arange(n))
        micro_batches = local_micro_batches(batch, torch.arange(n), self.batching)
        outputs = run_micro_batches(self.chunks, micro_batches, lambda mb: partial(self._report, mb),
                                    forward_only=True)
        scores = share_rows([o["scores"] for o in outputs], micro_batches, (n, 1), torch.float32,
                            megatron_groups.device())
        return scores[:, 0].cpu()
