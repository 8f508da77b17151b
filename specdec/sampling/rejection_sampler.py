"""Speculative-decoding acceptance: rejection sampling and its greedy special case.

Speculative sampling (Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers
via Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding
with Speculative Sampling"). For one request the draft proposed tokens t_1..t_k, t_i
sampled from q_i; the target scored all of them in one pass, giving p_1..p_{k+1}
(p_i is the target's distribution for the position of t_i, p_{k+1} the one after t_k).

* **accepted** tokens: for i = 1..k in order, t_i is kept with probability
  min(1, p_i(t_i) / q_i(t_i)); the accepted tokens are the prefix up to the first rejection.
* **recovered** token: at the first rejection i, a replacement is sampled from the
  residual norm(max(0, p_i − q_i)) (from p_i itself if the residual is numerically all
  zero, i.e. p_i == q_i) and the round stops.
* **bonus** token: if all k were accepted, one more token is sampled from p_{k+1}.

Each round therefore emits num_accepted + 1 tokens, and every emitted token is
distributed exactly as the target would have sampled it — provided q is the very
distribution the draft sampled from and p carries the request's sampling transforms.
With k = 0 the round is plain sampling from p_1.

Results are batch tensors (`RejectionResult`: [batch, k_max+1] tokens, [batch] accepted counts)
padded with the one `PLACEHOLDER_TOKEN_ID`, which the gateway and the target also pad their draft
tokens with; callers convert them to lists once, at the edge.

Greedy requests use `greedy_accept` (accept while argmax(p_i) == t_i, then the target's
argmax), which draws no random numbers. Feeding greedy rows' one-hot p (see
`transforms.logits_to_probs`) to `rejection_sample` gives the same tokens.

The round runs in two halves, which the services split between them (target.proto,
`VerifyItem.sampling`): `draw_candidates`, where p is, draws for every position the token
the round emits if it stops there (recovered for i <= k, bonus for k + 1); then
`accept_candidates`, where the uniforms are, decides how many draft tokens to keep from
p_i(t_i) and q_i(t_i) alone and takes the candidate at the first rejection. Drawing the
candidates of positions the round never reaches changes nothing: they are independent of
the uniforms and never seen. `rejection_sample` is the two halves in one process.

Randomness in `rejection_sample`: with a list of per-row generators each row draws, from
its own generator, first its k + 1 candidates and then its k uniforms, so a seeded request
reproduces whatever it is batched with. A single shared generator or None (torch's default RNG)
draws the whole batch in two calls — much faster for large statistical batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.errors import InvalidArgumentError
from specdec.sampling.draws import Generators, drawn_tokens, sample

#: Fills positions without a token in the sampler's padded tensors: draft tokens past a row's K
#: (the gateway's and the target's alike) and a round's output past its emitted tokens. The rule:
#: one negative id, never a vocabulary id, so a padded position that leaked into a gather or the
#: output would fail loudly (or read as no token) instead of passing for token 0.
PLACEHOLDER_TOKEN_ID = -1


@dataclass(frozen=True, eq=False)  # tensors: compare `token_lists()` or the tensors themselves
class RejectionResult:
    """Outcome of one speculation round for the whole batch, as tensors: the caller converts them
    to host lists once (`token_lists`), not once per request."""

    #: [batch, k_max+1] int64: row b's num_accepted[b] accepted draft tokens, then exactly one
    #: recovered or bonus token, then PLACEHOLDER_TOKEN_ID.
    output_tokens: torch.Tensor
    #: [batch] int64: how many draft tokens each row accepted.
    num_accepted: torch.Tensor

    def token_lists(self) -> list[list[int]]:
        """Each row's emitted tokens (accepted, then recovered or bonus) as a host list; the
        placeholders dropped. One device-to-host copy for the batch."""
        return [row[: n + 1] for row, n in zip(self.output_tokens.tolist(), self.num_accepted.tolist())]

    def last_tokens(self) -> torch.Tensor:
        """[batch] int64: each row's recovered or bonus token."""
        return self.output_tokens.gather(1, self.num_accepted[:, None]).squeeze(1)


def _check(
    target: torch.Tensor, draft_tokens: torch.Tensor, num_draft_tokens: Sequence[int] | torch.Tensor
) -> tuple[list[int], torch.Tensor]:
    """Validated per-row k as a list and a mask [batch, k_max] of real draft positions."""
    batch, k_plus_1 = target.shape[:2]
    k_max = k_plus_1 - 1
    if tuple(draft_tokens.shape) != (batch, k_max):
        raise InvalidArgumentError(
            f"draft_tokens: expected shape {(batch, k_max)}, got {tuple(draft_tokens.shape)}", field="draft_tokens"
        )
    ks = num_draft_tokens.tolist() if isinstance(num_draft_tokens, torch.Tensor) else list(num_draft_tokens)
    if len(ks) != batch or any(not 0 <= k <= k_max for k in ks):
        raise InvalidArgumentError(f"num_draft_tokens: expected {batch} values in [0, {k_max}], got {ks}",
                                   field="num_draft_tokens")
    k_t = torch.tensor(ks, dtype=torch.int64, device=target.device)  # [batch]
    valid = torch.arange(k_max, device=target.device)[None, :] < k_t[:, None]  # [batch, k_max]
    return ks, valid


def _result(
    draft_tokens: torch.Tensor,  # [batch, k_max] int64
    num_accepted: torch.Tensor,  # [batch] int64
    last: torch.Tensor,  # [batch] int64: the recovered or bonus token
) -> RejectionResult:
    """The accepted prefix of each row's draft, its `last` token after it, placeholders past that."""
    batch, k_max = draft_tokens.shape
    placeholders = draft_tokens.new_full((batch, 1), PLACEHOLDER_TOKEN_ID)  # [batch, 1]
    padded = torch.cat([draft_tokens, placeholders], dim=1)  # [batch, k_max+1]
    positions = torch.arange(k_max + 1, device=draft_tokens.device)[None, :]  # [1, k_max+1]
    output = torch.where(positions < num_accepted[:, None], padded, PLACEHOLDER_TOKEN_ID)  # [batch, k_max+1]
    return RejectionResult(output.scatter(1, num_accepted[:, None], last[:, None]), num_accepted)


def acceptance_probs(
    target_token_probs: torch.Tensor,  # [batch, k] p_i(t_i)
    draft_token_probs: torch.Tensor,  # [batch, k] q_i(t_i)
) -> torch.Tensor:
    """min(1, p_i(t_i) / q_i(t_i)) per draft position → [batch, k] float32.

    Where q_i(t_i) == 0 (impossible for a token the draft sampled) it is 1 if p_i(t_i) > 0
    else 0.
    """
    p, q = target_token_probs.float(), draft_token_probs.float()
    return torch.where(q > 0, (p / q).clamp(max=1.0), (p > 0).float())


def token_probs(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """probs [batch, >= k, vocab] at tokens [batch, k] (ids, or PLACEHOLDER_TOKEN_ID past a
    row's K) → [batch, k] float32. A placeholder reads token 0's probability: past its K no
    row is judged, and a gather needs an index in range."""
    k = tokens.shape[1]
    index = tokens.clamp(min=0)[..., None]  # [batch, k, 1]
    return probs[:, :k].gather(-1, index).squeeze(-1).float()


def residual_weights(
    target_probs: torch.Tensor,  # [batch, vocab] p_i at the rejected position
    draft_probs: torch.Tensor,  # [batch, vocab] q_i at the rejected position
) -> torch.Tensor:
    """max(0, p − q), unnormalized → [batch, vocab] float32; p itself where that is all zero
    (p == q). What a draw needs: `draws.sample` normalizes its weights."""
    p = target_probs.float()  # [batch, vocab]
    residual = (p - draft_probs.float()).clamp_(min=0.0)  # [batch, vocab]
    empty = residual.sum(dim=-1) <= 0  # [batch]
    if bool(empty.any()):
        residual[empty] = p[empty]
    return residual


def recovery_probs(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p − q)) → [batch, vocab] float32; p itself where the residual is all zero."""
    weights = residual_weights(target_probs, draft_probs)  # [batch, vocab]
    return weights / weights.sum(dim=-1, keepdim=True)


def _uniforms(ks: list[int], k_max: int, generators: Generators, device: torch.device) -> torch.Tensor:
    """[batch, k_max] uniforms in [0, 1); per-row generators draw exactly k_b values each."""
    if generators is None or isinstance(generators, torch.Generator):
        return torch.rand(len(ks), k_max, generator=generators, device=device)
    if len(generators) != len(ks):
        raise InvalidArgumentError(f"generators: got {len(generators)} for {len(ks)} rows", field="generators")
    rows = [
        torch.cat([torch.rand(k, generator=g, device=device), torch.ones(k_max - k, device=device)])
        for k, g in zip(ks, generators)
    ]  # [k_max] each; padding 1.0 is never accepted
    return torch.stack(rows) if rows else torch.empty(0, k_max, device=device)


def draw_candidates(
    target_probs: torch.Tensor,  # [n, vocab] p at each position
    draft_probs: torch.Tensor,  # [n, vocab] q at each draft position; an all-zero row at a bonus position
    generators: Generators = None,  # one per row, or shared
) -> torch.Tensor:
    """The token each position emits if the round stops there → [n] int64: a draw from the
    residual norm(max(0, p − q)) at a draft position, from p itself at the bonus position
    (whose q row is all zero, so the residual is p)."""
    return sample(residual_weights(target_probs, draft_probs), generators)


def accept_candidates(
    target_token_probs: torch.Tensor,  # [batch, k_max] p_i(t_i), anything past each row's k
    draft_token_probs: torch.Tensor,  # [batch, k_max] q_i(t_i), anything past each row's k
    draft_tokens: torch.Tensor,  # [batch, k_max] int, PLACEHOLDER_TOKEN_ID (or anything) past each row's k
    num_draft_tokens: Sequence[int] | torch.Tensor,  # [batch] k per row, 0 <= k <= k_max
    candidates: torch.Tensor,  # [batch, k_max+1] int: `draw_candidates` at positions 1..k+1, anything past
    generators: Generators = None,
) -> RejectionResult:
    """Accept t_i with probability min(1, p_i(t_i) / q_i(t_i)) while they are accepted, then
    emit the candidate of the first unaccepted position (recovered, or the bonus)."""
    ks, valid = _check(candidates, draft_tokens, num_draft_tokens)  # valid: [batch, k_max]
    device = candidates.device
    drafted = draft_tokens.to(device=device, dtype=torch.int64)  # [batch, k_max]
    tokens = torch.where(valid, drafted, PLACEHOLDER_TOKEN_ID)  # [batch, k_max]
    uniforms = _uniforms(ks, tokens.shape[1], generators, device)  # [batch, k_max]
    accepted = (uniforms < acceptance_probs(target_token_probs, draft_token_probs)) & valid  # [batch, k_max]
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [batch]
    last = candidates.to(torch.int64).gather(1, num_accepted[:, None]).squeeze(1)  # [batch]
    return _result(tokens, num_accepted, last)


def rejection_sample(
    target_probs: torch.Tensor,  # [batch, k_max+1, vocab] p, request's transforms applied
    draft_probs: torch.Tensor,  # [batch, k_max, vocab] the exact q each draft token was sampled from
    draft_tokens: torch.Tensor,  # [batch, k_max] int, PLACEHOLDER_TOKEN_ID (or anything) past each row's k
    num_draft_tokens: Sequence[int] | torch.Tensor,  # [batch] k per row, 0 <= k <= k_max
    generators: Generators = None,
) -> RejectionResult:
    """One speculative-sampling round for a batch: `draw_candidates` then `accept_candidates`
    (see the module docstring)."""
    batch, k_plus_1, vocab = target_probs.shape
    k_max = k_plus_1 - 1
    if tuple(draft_probs.shape) != (batch, k_max, vocab):
        raise InvalidArgumentError(
            f"draft_probs: expected shape {(batch, k_max, vocab)}, got {tuple(draft_probs.shape)}", field="draft_probs"
        )
    ks, valid = _check(target_probs, draft_tokens, num_draft_tokens)  # valid: [batch, k_max]
    device = target_probs.device
    drafted = draft_tokens.to(device=device, dtype=torch.int64)  # [batch, k_max]
    tokens = torch.where(valid, drafted, PLACEHOLDER_TOKEN_ID)  # [batch, k_max]
    q = torch.cat([draft_probs.to(target_probs.dtype), target_probs.new_zeros(batch, 1, vocab)],
                  dim=1)  # [batch, k_max+1, vocab]
    q[:, :k_max].masked_fill_(~valid[..., None], 0.0)  # each row's bonus position has no q
    reached = (torch.arange(k_plus_1, device=device)[None, :]
               <= torch.tensor(ks, device=device)[:, None])  # [batch, k_max+1]
    if isinstance(generators, torch.Generator) or generators is None:
        row_generators: Generators = generators
    else:
        if len(generators) != batch:
            raise InvalidArgumentError(f"generators: got {len(generators)} for {batch} rows", field="generators")
        row_generators = [g for g, k in zip(generators, ks) for _ in range(k + 1)]
    candidates = torch.full((batch, k_plus_1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64,
                            device=device)  # [batch, k_max+1]: never reached past each row's K + 1
    candidates[reached] = draw_candidates(target_probs[reached], q[reached], row_generators)
    result = accept_candidates(
        token_probs(target_probs, tokens), token_probs(draft_probs, tokens), tokens, ks, candidates, generators
    )
    drawn_tokens(result.last_tokens())  # the round's recovered or bonus draws
    return result


def greedy_accept(
    target_logits: torch.Tensor,  # [batch, k_max+1, vocab] (penalized logits, or probs: only argmax matters)
    draft_tokens: torch.Tensor,  # [batch, k_max] int, PLACEHOLDER_TOKEN_ID (or anything) past each row's k
    num_draft_tokens: Sequence[int] | torch.Tensor,  # [batch]
) -> RejectionResult:
    """Greedy round: accept t_i while argmax(target_i) == t_i, then emit the target's
    argmax at the first mismatch (or at position k, the bonus). Draws no randomness.

    Apply the logit bias and penalties first (`transforms.chunk_adjust_logits`) for
    requests that use them: greedy decoding takes the argmax of the adjusted logits.
    """
    return greedy_accept_argmax(target_logits.argmax(dim=-1), draft_tokens, num_draft_tokens)


def greedy_accept_argmax(
    target_argmax: torch.Tensor,  # [batch, k_max+1] int: argmax of the target's logits at each position
    draft_tokens: torch.Tensor,  # [batch, k_max] int, PLACEHOLDER_TOKEN_ID (or anything) past each row's k
    num_draft_tokens: Sequence[int] | torch.Tensor,  # [batch]
) -> RejectionResult:
    """`greedy_accept` from the target's argmax tokens instead of its logits (the target
    service can send those alone for requests whose logits need no transform)."""
    _, valid = _check(target_argmax, draft_tokens, num_draft_tokens)  # valid: [batch, k_max]
    k_max = target_argmax.shape[1] - 1
    best = target_argmax.to(torch.int64)  # [batch, k_max+1]
    tokens = draft_tokens.to(device=best.device, dtype=torch.int64)  # [batch, k_max]
    matches = (best[:, :k_max] == tokens) & valid  # [batch, k_max]
    num_accepted = matches.long().cumprod(dim=1).sum(dim=1)  # [batch]
    last = best.gather(1, num_accepted[:, None]).squeeze(1)  # [batch]
    return _result(tokens, num_accepted, last)
