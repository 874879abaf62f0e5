"""What a decode engine loads for one request, decided once, when vLLM first asks.

The decode scheduler checks a request's ``kv_transfer_params`` (every type,
range and charset, the capability's HMAC and expiry, the prompt length and
the KV cache group count) the first time vLLM asks how many tokens it may
load (``get_num_new_matched_tokens``; params already parsed on arrival for
lease heartbeats are not parsed again), and keeps the outcome, a
:class:`DecodeLoad`, until vLLM has allocated the request's blocks
(``update_state_after_alloc``) or the request finishes. Allocation uses the
kept value as it is and checks nothing again: a capability that expires
between the two calls cannot turn a load vLLM was promised into no load at
all (a request vLLM would wait on for ever). If the prefill engine's hold
has really ended by then, the pull fails (its fence question) and its
blocks reach vLLM as load errors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from p2pkv.params import KVTransferParamsError, RemotePrefill, check_kv_groups
from p2pkv.prompt_digest import DIGEST_KEY, prompt_digest


@dataclass(frozen=True)
class DecodeLoad:
    """One request's load from a prefill engine, as checked when vLLM first asked.

    Attributes:
        remote: where the KV is: the prefill engine, its request id and its
            block ids (``remote.block_ids``, in the prefill engine's blocks),
            capability checked.
        prompt_tokens: tokens of the prefill prompt: this request's prompt
            less the tokens the proxy appended (``remote.appended_tokens``);
            at least 1.
        loaded_tokens: prompt tokens, from token 0, whose KV a full load
            leaves on this engine: all ``prompt_tokens`` but the last
            ``recompute_tokens`` (tokens), which the decode engine computes
            itself.
        grant: the stream grant of a layer-streamed load (:mod:`p2pkv.grant`; "" for pull and push).
    """

    remote: RemotePrefill
    prompt_tokens: int
    loaded_tokens: int
    grant: str = ""

    def __post_init__(self) -> None:
        if not 0 < self.loaded_tokens <= self.prompt_tokens:
            raise ValueError(f"loaded_tokens={self.loaded_tokens} must be in 1..prompt_tokens={self.prompt_tokens}")

    @classmethod
    def streamed(cls, remote: RemotePrefill, grant: str, prompt_token_ids: Sequence[int],
                 recompute_tokens: int) -> DecodeLoad:
        """The load of a layer-streamed request: every prompt token but the last ``max(1, recompute_tokens)``,
        which this engine computes (its first output token comes from here: the proxy sent both legs at once,
        so no prefill token was appended). ``remote`` is given this prompt's digest of those tokens, which the
        prefill rank compares with its own before it WRITEs.

        Raises:
            KVTransferParamsError: a prompt too short to stream (one token).
        """
        prompt = len(prompt_token_ids)
        loaded = prompt - max(1, recompute_tokens)
        if loaded < 1:
            raise KVTransferParamsError(f"a prompt of {prompt} token(s) leaves nothing to stream: this engine "
                                        "computes its last token itself")
        remote = dataclasses.replace(remote, num_tokens=loaded, prompt_digest=prompt_digest(prompt_token_ids[:loaded]))
        return cls(remote, prompt, loaded, grant)

    @classmethod
    def of(cls, remote: RemotePrefill, prompt_token_ids: Sequence[int], recompute_tokens: int,
           kv_groups: int) -> DecodeLoad:
        """The load of ``remote``'s KV into a request whose prompt is ``prompt_token_ids``.

        Args:
            remote: the request's parsed (and capability-checked) params.
            prompt_token_ids: this request's prompt token ids (the proxy's
                appended tokens included).
            recompute_tokens: trailing prompt tokens the decode engine
                computes itself instead of loading (tokens; see
                :class:`p2pkv.scheduler.SchedulerSide`).
            kv_groups: KV cache groups of this engine (:func:`p2pkv.params.parse_remote_prefill` refuses
                another count before the MAC when given ``kv_groups``, as the decode scheduler gives it;
                checked here again, with the same message, for params parsed without).

        Raises:
            KVTransferParamsError: the params belong to another prompt
                (``appended_tokens`` leaves no prompt, ``remote_num_tokens``
                is not the tokens this engine would load, or the tokens it
                would load are not those ``remote_prompt_digest`` names), or name another
                number of KV cache groups than this engine has. The message
                names the key.
        """
        request_tokens = len(prompt_token_ids)
        prompt = request_tokens - remote.appended_tokens
        if prompt < 1:
            raise KVTransferParamsError(
                f"kv_transfer_params.appended_tokens={remote.appended_tokens} but the prompt has only "
                f"{request_tokens} tokens: the params belong to another prompt")
        loaded = prompt - recompute_tokens if prompt > recompute_tokens else prompt
        if remote.num_tokens and remote.num_tokens != loaded:
            why = (f"the prefill prompt has {prompt} tokens" if loaded == prompt else
                   f"this model's prefill engine computes all but the last {prompt - loaded} of the prefill "
                   f"prompt's {prompt} tokens")
            raise KVTransferParamsError(
                f"kv_transfer_params.remote_num_tokens={remote.num_tokens} but {why}: the params belong to "
                "another prompt (send each prompt with its own params)")
        if remote.prompt_digest and prompt_digest(prompt_token_ids[:loaded]) != remote.prompt_digest:
            raise KVTransferParamsError(
                f"kv_transfer_params.{DIGEST_KEY} does not match this request's first {loaded} prompt tokens: "
                "the params belong to another prompt (send each prompt with its own params)")
        check_kv_groups(len(remote.groups()), kv_groups)  # the decode scheduler's parse checked it already
        return cls(remote, prompt, loaded)

    @classmethod
    def turn(cls, remote: RemotePrefill, prompt_token_ids: Sequence[int], kv_groups: int) -> DecodeLoad:
        """The load of the KV a decode engine kept for a conversation's earlier turns (``remote.num_tokens``
        tokens: those turns' prompt and answer) into this turn's prefill, which computes the tokens after them.

        Args:
            remote: the prefill leg's parsed (and capability-checked) turn params.
            prompt_token_ids: this turn's prompt token ids.
            kv_groups: KV cache groups of this engine.

        Raises:
            KVTransferParamsError: the params bind no tokens (``remote_prompt_digest`` missing), the prompt does not
                extend the kept tokens by at least one (the client edited an earlier message, or the params are
                another conversation's), or they name another number of KV cache groups. The message names the
                key.
        """
        kept, prompt = remote.num_tokens, len(prompt_token_ids)
        if not remote.prompt_digest:
            raise KVTransferParamsError(f"kv_transfer_params.{DIGEST_KEY} is missing: a kept turn's params must "
                                        "bind the tokens its blocks hold")
        if not 0 < kept < prompt:
            raise KVTransferParamsError(
                f"kv_transfer_params.remote_num_tokens={kept} but this prompt has {prompt} tokens: a turn reuses "
                "kept tokens only for a prompt that extends them")
        if prompt_digest(prompt_token_ids[:kept]) != remote.prompt_digest:
            raise KVTransferParamsError(
                f"kv_transfer_params.{DIGEST_KEY} does not match this request's first {kept} prompt tokens: the "
                "conversation changed since that turn (an earlier message edited), or the params are another's")
        check_kv_groups(len(remote.groups()), kv_groups)
        return cls(remote, prompt, kept)
