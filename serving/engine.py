"""The engine: requests in, tokens out. One step reads top to bottom: the scheduler picks tokens, the model runner
computes them as one flattened batch over the paged K/V pool, each request's logits rows become tokens (sampled, or
its draft tree verified and rolled back), and the speculator drafts the next step's trees."""
from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from serving import kernels, kv_groups, targets
from serving.attention import KVCache
from serving.config import EngineConfig, resolve_device
from serving.drafters.context import StepOutputs
from serving.model import Model
from serving.model_runner import ModelRunner, RunOutput
from serving.request import Request, RequestOutput, SamplingParams
from serving.sampler import make_generator, next_token, prompt_ranks, token_logprobs
from serving.scheduler import Scheduler
from serving.spec_decode.config import SpeculativeConfig
from serving.spec_decode.grammar import row_masks
from serving.spec_decode.speculator import Speculator
from serving.structured_output import Grammars, mask_logits

log = logging.getLogger(__name__)


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


class Engine:
    def __init__(self, config: EngineConfig | None = None):
        config = config or EngineConfig()
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.folder = targets.resolve(config.target)
        self.device = resolve_device(config.device)
        # dtype bfloat16 where serving/kernels.c runs: bfloat16 products (weights and the activations entering each
        # product) summed in float32, around a float32 residual stream, norms, attention and K/V; elsewhere torch's
        # bfloat16 operators
        bf16_compute = config.dtype == "bfloat16" and self.device.type == "cpu" and kernels.library() is not None
        self.compute = torch.bfloat16 if bf16_compute else torch.float32
        self.dtype = torch.float32 if bf16_compute else config.torch_dtype
        weights = torch.bfloat16 if bf16_compute else config.weight_dtype
        model = Model.from_folder(self.folder, self.dtype, self.device, weights, self.compute)
        self.products = (kernels.product_path(weights, self.compute) if self.device.type == "cpu"
                         else f"torch operators in {self.dtype}".replace("torch.", ""))
        model_config = model.config
        self.max_model_len = _max_model_len(config.max_model_len, model_config.max_position_embeddings)
        self.tokenizer = _load_tokenizer(self.folder)
        self.grammars = Grammars.from_hf(self.tokenizer, model_config.vocab_size, model_config.eos_token_ids, self.folder)
        layer, block_size = model_config.layer, config.block_size
        layer_block_bytes = KVCache.bytes_per_block(1, block_size, layer.num_kv_heads, layer.head_dim, self.dtype)
        windows = model_config.windows or (0,) * model_config.num_layers
        groups = kv_groups.plan(windows, num_blocks=config.num_blocks,
                                memory_bytes=int(config.kv_cache_memory_gib * 2**30), layer_block_bytes=layer_block_bytes,
                                block_size=block_size, max_model_len=self.max_model_len,
                                max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens)
        needed, available = kv_groups.pool_bytes(groups, layer_block_bytes), available_memory_bytes(self.device)
        if needed > 0.9 * available:
            fits = int(0.9 * available) // (layer_block_bytes * len(windows))
            raise ValueError(f"num_blocks={groups[0].num_blocks} needs {needed / 2**30:.1f} GiB of K/V cache but only "
                             f"{available / 2**30:.1f} GiB is available on {self.device}: at most {fits} blocks of "
                             f"{block_size} tokens fit")
        self.block_size = block_size
        caches, layer_groups = kv_groups.build_caches(groups, block_size, layer.num_kv_heads, layer.head_dim, self.dtype,
                                                      self.device, layer.attention_scale, model.attention_sinks())
        self.runner = ModelRunner(model, caches, block_size, self.dtype, self.device, layer_groups)
        # Prefix-cache hits skip the forward, so a capturing engine would miss those hidden states.
        self.block_manager = kv_groups.build_manager(groups, block_size,
                                                     config.enable_prefix_caching and not config.capture_hidden)
        self.scheduler = Scheduler(self.block_manager, max_model_len=self.max_model_len, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens)
        self.capture_hidden = config.capture_hidden
        self.aux_layers = config.aux_layers
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self._ids = itertools.count()
        self.speculator = None
        self.set_speculative_config(config.speculative_config)

    @property
    def model(self) -> Model:
        return self.runner.model

    @property
    def cache(self) -> KVCache:
        """The full-attention group's pool (every layer's when the target has no sliding window); each group's:
        `runner.caches`."""
        return self.runner.cache

    def set_speculative_config(self, config: SpeculativeConfig | str | dict | None) -> None:
        """Switches drafting on (or off with None) for the requests added from now on; the target stays loaded."""
        if isinstance(config, (str, dict)):
            config = SpeculativeConfig.from_json(config)
        self.use_speculator(Speculator(self, config) if config else None)

    def use_speculator(self, speculator: Speculator | None) -> None:
        """Switches to a speculator built for this engine before (a bench builds each once and takes turns)."""
        if self.has_unfinished():
            raise RuntimeError("change the speculative config only while the engine is idle")
        if speculator is not None and self.capture_hidden:
            raise ValueError("capture_hidden and speculative decoding cannot be combined: capture with plain decoding")
        self.speculator = speculator
        # A drafter's pool holds nothing for blocks cached so far, and a feature drafter's K/V at the last
        # slot of a block depends on the token after it.
        self.block_manager.reset_prefix_cache()
        self.block_manager.num_lookahead = self.speculator.drafter.num_lookahead if self.speculator else 0
        if not self.capture_hidden:
            self.aux_layers = self.speculator.drafter.aux_layers if self.speculator else ()
        if speculator is not None and speculator.policy and not speculator.is_calibrated:
            speculator.calibrate(self)

    @functools.cached_property
    def step_cost(self):
        """What a target forward costs here by rows and sequences (serving.spec_decode.cost), from the cache or measured
        now, once: the adaptive policy's price list."""
        from serving.spec_decode.cost import load_or_measure

        return load_or_measure(self)

    @functools.cached_property
    def fingerprint(self) -> dict:
        """The target's identity (serving.targets.fingerprint), computed once: heads and stores check it."""
        return targets.fingerprint(self.folder)

    # ---- requests -------------------------------------------------------------------------------------

    def encode(self, prompt) -> list[int]:
        """A prompt is token ids, a string, or chat messages (rendered by the target's chat template)."""
        return encode(self.tokenizer, prompt, self.folder)

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        params = params or SamplingParams()
        ids = self.encode(prompt)
        self._validate(ids, params)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        eos = () if params.ignore_eos else self.model.config.eos_token_ids
        request = Request(request_id, ids, params, eos)
        if params.structured_outputs is not None:
            request.grammar = self.grammars.matcher(params.structured_outputs)
        if not params.is_greedy:
            request.generator = make_generator(params.seed)
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}: "
                             f"shorten the prompt to at most {self.max_model_len - 1} tokens")
        vocab = self.model.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"SamplingParams.stop needs a tokenizer and target {self.folder} has none: use stop_token_ids")
        if params.logit_bias and not all(0 <= token < vocab for token in params.logit_bias):
            raise ValueError(f"SamplingParams.logit_bias keys must be token ids in [0, {vocab})")
        if params.structured_outputs is not None:
            self.grammars.matcher(params.structured_outputs)  # compiled once per grammar: a bad one fails here

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self, request_id: str) -> bool:
        """Drops a waiting or running request between steps: its blocks go back to the pool, its drafter state and
        generator are dropped, and it returns no output. False if no such request is in the engine (it finished)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.finish(request, "abort")
        self._forget(request)
        return True

    # ---- one step -------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one step; returns the outputs of requests that finished in it."""
        step_start = time.perf_counter()
        plan = self.scheduler.schedule()
        for request in plan.preempted:
            self._forget(request)
        if not plan.scheduled:
            if self.scheduler.running or self.scheduler.waiting:
                raise RuntimeError("the K/V pool is too small to schedule any request: raise num_blocks")
            return []
        needs_hidden = self.capture_hidden or bool(self.speculator and self.speculator.drafter.needs_hidden)
        run = self.runner.run(plan.scheduled, needs_hidden, self.aux_layers)
        self.num_steps += 1
        accepted_paths = self._emit(run)  # tokens sampled, or trees verified and rolled back
        # A capturing request runs one more step over its last token, so every token has its hidden state.
        finishing = [r for r in run.batch.requests if r.finish_reason and not (
            self.capture_hidden and r.num_computed_tokens < r.num_tokens)]
        step = StepOutputs(run, accepted_paths, time.perf_counter() - step_start)
        if self.speculator:
            self.speculator.observe(step)  # before finishing requests leave: the blocks they register need it
        finished = [self._finish(request) for request in finishing]
        if self.speculator:
            self.speculator.propose(step)
        for request in run.batch.requests:  # after drafting, whose slot reservations trim nothing kept
            if not request.is_finished:
                self._cache_blocks(request)
        return finished

    def _emit(self, run: RunOutput) -> dict[str, list[int]]:
        """Each request's computed tokens advance; one whose chunk reached its end emits: plain decoding samples one
        token from its first logits row, speculation verifies its tree over 1 + nodes rows and rolls back. Returns the
        accepted path of each verified tree."""
        batch, out, accepted_paths = run.batch, run.out, {}
        for i, (request, num) in enumerate(zip(batch.requests, batch.num_scheduled)):
            if self.capture_hidden:
                rows = slice(batch.token_start[i], batch.token_start[i] + num)
                request.captured.append((_to_host(out.hidden[rows]), {k: _to_host(v[rows]) for k, v in out.aux.items()}))
            if i in batch.prompt_rows:
                self._prompt_logprobs(request, out.logits, *batch.prompt_rows[i], request.num_computed_tokens + num)
            request.num_computed_tokens += num
            row = batch.logits_start[i]
            if row < 0 or request.finish_reason:
                continue
            rows = slice(row, row + 1 + len(request.spec.tree))
            logits, best = out.logits[rows], run.argmax[rows]
            is_decode = request.num_output_tokens > 0
            speculating = self.speculator is not None and self.speculator.can_speculate(request)
            num_before = request.num_tokens
            if speculating and request.spec.tree.num_rows:
                tree = request.spec.tree
                if request.params.logprobs and request.grammar is not None:  # before verify and _append move on
                    logits = mask_logits(logits, row_masks(self.grammars, request.grammar, tree))
                tree, path, tokens = self.speculator.verify(request, logits, best)
                # emitted token d came from the row of the path's node d - 1 (row 0: the newest token's)
                self._append(request, tokens, logits[[0] + [1 + node for node in path]])
                accepted_paths[request.request_id] = path
                if is_decode:
                    self.speculator.record(request, tree, path, request.num_tokens - num_before)
            else:  # plain decoding, or a speculated step with no drafts
                if request.grammar is not None:
                    logits, best = mask_logits(logits[:1], self.grammars.bitmask(request.grammar)), [None]
                token = next_token(logits[0], request, request.generator, best[0])
                self._append(request, [token], logits[:1])
                if speculating and is_decode:  # counted as a verify step
                    self.speculator.record_undrafted(request, request.num_tokens - num_before)
        return accepted_paths

    @staticmethod
    def _prompt_logprobs(request: Request, logits: torch.Tensor, first_row: int, first_token: int, end: int) -> None:
        """The logprobs of the prompt tokens after a chunk's rows (first_token .. the token after the chunk's last,
        `end` its end) from the logits rows before each, from first_row on (a preempted request recomputes them into
        the same places)."""
        positions = range(first_token, min(end + 1, request.num_prompt_tokens))
        tokens = [request.token_ids[p] for p in positions]
        rows = logits[first_row:first_row + len(tokens)]
        chosen, top = token_logprobs(rows, tokens, request.params.prompt_logprobs)
        ranks = prompt_ranks(rows, tokens)
        for p, logprob, rank, likeliest in zip(positions, chosen, ranks, top):
            request.prompt_logprobs[p] = (logprob, rank, likeliest)

    def _finish(self, request: Request) -> RequestOutput:
        self._cache_blocks(request)
        self.scheduler.finish(request, request.finish_reason)
        output = self.output(request)
        del self.requests[request.request_id]
        self._forget(request)
        return output

    def _forget(self, request: Request) -> None:
        """Drops what a request built while it ran: its captured rows and its speculative state (preempted ones start
        over; finished and aborted ones leave)."""
        request.captured = []
        if self.speculator:
            self.speculator.reset(request)

    def _cache_blocks(self, request: Request) -> None:
        num_before = len(request.block_hashes)
        self.block_manager.cache_blocks(request, min(request.num_computed_tokens, request.num_tokens))
        if self.speculator and len(request.block_hashes) > num_before:
            self.speculator.registered(request, num_before)

    def _append(self, request: Request, tokens: list[int], rows: torch.Tensor) -> None:
        """Appends emitted tokens, stopping at the first that ends the request. rows: [len(tokens), vocab] the
        target's logits each token was emitted from (its logprobs are read there, when asked)."""
        p = request.params
        if request.first_token_time is None:
            request.first_token_time = time.perf_counter()
        logprobs, top = token_logprobs(rows, tokens, p.top_logprobs) if p.logprobs else ([], [])
        for i, token in enumerate(tokens):
            request.token_ids.append(token)
            if p.logprobs:
                request.logprobs.append(logprobs[i])
                request.top_logprobs.append(top[i])
            if request.grammar is not None and not request.grammar.consume_token(token):
                raise RuntimeError(f"request {request.request_id} emitted token {token}, which its grammar forbids: "
                                   f"{request.grammar.get_error()}")
            if token in request.eos_token_ids or (p.stop_token_ids and token in p.stop_token_ids):
                request.finish_reason = "stop"
            elif request.grammar is not None and request.grammar.is_stopped():
                request.finish_reason = "stop"  # the grammar is complete: nothing but the end may follow
            elif p.stop and self._hits_stop_string(request):
                request.finish_reason = "stop"
            elif request.num_output_tokens >= p.max_tokens or request.num_tokens >= self.max_model_len:
                request.finish_reason = "length"
            if request.finish_reason:
                request.finish_time = time.perf_counter()
                return

    def _hits_stop_string(self, request: Request) -> bool:
        tail = self.tokenizer.decode(request.output_token_ids[-32:], skip_special_tokens=True)
        return any(s in tail for s in request.params.stop)

    def output(self, request: Request) -> RequestOutput:
        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
            if request.params.stop and request.finish_reason == "stop":
                cuts = [text.find(s) for s in request.params.stop if s in text]
                text = text[:min(cuts)] if cuts else text
        end = request.finish_time or time.perf_counter()
        metrics = {
            "num_prompt_tokens": request.num_prompt_tokens,
            "num_output_tokens": request.num_output_tokens,
            "num_cached_tokens": request.num_cached_tokens,
            "num_preemptions": request.num_preemptions,
            "time_to_first_token_s": (request.first_token_time or end) - request.arrival_time,
            "latency_s": end - request.arrival_time,
        }
        if request.spec.stats is not None:
            metrics["spec"] = request.spec.stats.to_dict()
        output = RequestOutput(request.request_id, request.token_ids[:request.num_prompt_tokens], request.output_token_ids,
                               text, request.finish_reason, request.is_finished,
                               request.logprobs if request.params.logprobs else None, metrics=metrics,
                               top_logprobs=request.top_logprobs if request.params.top_logprobs else None,
                               prompt_logprobs=request.prompt_logprobs if request.params.prompt_logprobs is not None
                               else None)
        if self.capture_hidden and request.is_finished:
            output.hidden = torch.cat([hidden for hidden, _ in request.captured])
            output.aux = {layer: torch.cat([aux[layer] for _, aux in request.captured]) for layer in self.aux_layers}
        return output

    # ---- offline generation ---------------------------------------------------------------------------

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = False) -> list[RequestOutput]:
        """Generates for every prompt (strings, token id lists or chat message lists); outputs in prompt order.
        Every prompt is validated before any work starts."""
        prompts = list(prompts)
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        encoded = []
        for i, (prompt, sp) in enumerate(zip(prompts, params_list)):
            try:
                ids = self.encode(prompt)
                self._validate(ids, sp or SamplingParams())
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            encoded.append(ids)
        ids = [self.add_request(p, sp) for p, sp in zip(encoded, params_list)]
        results: dict[str, RequestOutput] = {}
        bar = _progress(len(ids), progress)
        while self.has_unfinished():
            for output in self.step():
                results[output.request_id] = output
                bar.update(1)
        bar.close()
        return [results[i] for i in ids]


def _max_model_len(asked, model_max: int) -> int:
    """The context the engine serves: `asked`, at most the model's max_position_embeddings (lowered with a warning),
    or the model's maximum when None."""
    if asked is None:
        return model_max
    if not isinstance(asked, int) or isinstance(asked, bool) or asked < 2:
        raise ValueError(f"max_model_len={asked!r} must be an integer >= 2 (a prompt token and one to generate), or "
                         "unset for the model's maximum")
    if asked > model_max:
        log.warning("max_model_len=%d exceeds the target's max_position_embeddings (%d): serving %d tokens", asked,
                    model_max, model_max)
        return model_max
    return asked


def encode(tokenizer, prompt, folder: Path, tools: list[dict] | None = None) -> list[int]:
    """A prompt as token ids: token ids as they are, a string tokenized without special tokens, chat messages rendered by
    the target's chat template (with `tools`, OpenAI's function definitions, where given). `folder` names the target
    in errors."""
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        if tokenizer is None or not tokenizer.chat_template:
            raise ValueError(f"target {folder} has no chat template: pass a string or token ids")
        ids = tokenizer.apply_chat_template(list(prompt), tools=tools, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"target {folder} has no tokenizer: pass token ids")
        return tokenizer.encode(prompt, add_special_tokens=False)
    return [int(t) for t in prompt]


def _to_host(rows: torch.Tensor) -> torch.Tensor:
    """A copy in CPU memory: captured hidden states go to a store, and must not hold the device's memory meanwhile."""
    return rows.to("cpu", copy=True)


def _load_tokenizer(folder: Path):
    if not any((folder / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, desc="requests", unit="req")
