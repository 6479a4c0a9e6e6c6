"""Target-only decoding with the per-request logits controls, written without specserve code: transformers' own logits
processors (logit_bias as SequenceBiasLogitsProcessor, min_tokens as MinNewTokensLengthLogitsProcessor,
repetition_penalty as RepetitionPenaltyLogitsProcessor, min_p as MinPLogitsWarper) and, since transformers has no
presence or frequency processor, one written here from OpenAI's definition. The order is vLLM's: bias and min_tokens,
then the penalties, then (sampling only) temperature and min_p."""

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties: mu[j] - c[j] * frequency - (c[j] > 0) * presence, where c[j] counts
    token j among the tokens generated so far (the prompt's are not counted)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        out = scores.clone()
        for row in range(input_ids.shape[0]):
            counts = torch.bincount(input_ids[row, self.prompt_len :], minlength=scores.shape[-1])[: scores.shape[-1]]
            out[row] -= self.frequency * counts.float() + self.presence * (counts > 0).float()
        return out


def processors(controls: dict, prompt_len: int, eos_ids) -> LogitsProcessorList:
    """transformers' processors for `controls` (SamplingParams' field names), in vLLM's order."""
    out = LogitsProcessorList()
    if controls.get("logit_bias"):
        out.append(SequenceBiasLogitsProcessor([[[token], bias] for token, bias in controls["logit_bias"].items()]))
    if controls.get("min_tokens"):
        out.append(MinNewTokensLengthLogitsProcessor(prompt_len, controls["min_tokens"], list(eos_ids)))
    if controls.get("repetition_penalty", 1.0) != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(controls["repetition_penalty"]))
    if controls.get("presence_penalty") or controls.get("frequency_penalty"):
        presence, frequency = controls.get("presence_penalty", 0.0), controls.get("frequency_penalty", 0.0)
        out.append(OpenAIPenalties(prompt_len, presence, frequency))
    if controls.get("min_p"):
        out.append(MinPLogitsWarper(controls["min_p"]))  # argmax-invariant: greedy is unchanged by it
    return out


def hf_controlled_greedy(model, prompt_ids: list[int], max_new: int, controls: dict, eos_ids) -> list[int]:
    """transformers' greedy `generate` with the controls' processors: the generated token ids (EOS included)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids], device=model.device),
            do_sample=False,
            max_new_tokens=max_new,
            logits_processor=processors(controls, len(prompt_ids), eos_ids),
            eos_token_id=list(eos_ids),
            pad_token_id=list(eos_ids)[0],
        )
    return out[0, len(prompt_ids) :].tolist()


def controlled_logits_reference(logits: torch.Tensor, prefix: list[int], prompt_len: int, controls: dict, eos_ids):
    """One position's logits [V] after the controls' processors, for the sampling oracle (then temperature etc.)."""
    ids = torch.tensor([prefix], dtype=torch.long, device=logits.device)
    scores = logits.float().unsqueeze(0)
    for processor in processors({k: v for k, v in controls.items() if k != "min_p"}, prompt_len, eos_ids):
        scores = processor(ids, scores)
    return scores[0]
