"""Structured outputs with speculation (serving/structured_output.py, serving/spec_decode/grammar.py).

1. Bad structured outputs are clear errors where SamplingParams are made; a grammar compiles once per key.
2. Greedy: under a JSON schema, every drafter (n-gram chains, an untrained EAGLE-1 head as a chain and as a tree, a
   stub drafting random trees around plain decoding's continuation with wrong siblings) with and without grammar
   drafts gives plain decoding's tokens under the same grammar, at concurrency 1 and 4 and under preemption; every
   answer that ends is valid under the schema (jsonschema, not the grammar library). The target is tiny_llama (a
   vocabulary of 256) read by a byte-level tokenizer: token i is byte i, 2 the end.
3. Forbidden drafts: a stub proposing, beside plain decoding's continuation, a byte no JSON answer holds (with a
   child): those never reach the verified trees, and num_invalid_spec_tokens counts each with its subtree.
4. Sampled, exact: a vocabulary-8 target and a grammar that forbids some tokens at the first and second draft
   depths (a regex over letters); a stub drafts a tree of width 2 at depths 1 and 2 (likely tokens, or draws from
   an imperfect q), plus a forbidden node: over 6,000 seeded requests the law of (x2, x3) is, within TV 0.07, the
   masked target law sum_x1 p(x1) p(x2 | x1) p(x3 | x1, x2), each p the target's law with the grammar's
   forbidden tokens removed (from transformers); drafts accepted and rejected at both depths.
5. The server: response_format json_schema through the openai client returns JSON valid under the schema; a
   malformed schema is a 400 naming the problem, and the server keeps serving.
"""
from __future__ import annotations

import json

import jsonschema
import llguidance
import openai
import pytest
import torch

from serving import targets
from serving.config import EngineConfig
from serving.drafters.base import Drafter
from serving.engine import Engine
from serving.request import SamplingParams
from serving.sampler import sample, target_probs
from serving.server.app import build_app
from serving.spec_decode.tree import DraftTree
from serving.structured_output import Grammars, StructuredOutputs, grammar_text

from local_server import running
from test_head_drafters import random_head_dir
from test_spec import assert_pool_idle, make_engine, random_prompts
from test_trees import RandomTreeStub, TruthStub, assert_two_token_law

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5}, "kind": {"enum": ["cat", "dog"]},
                   "n": {"type": "integer", "maximum": 99}},
    "required": ["name", "kind", "n"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},  # llguidance's option: no whitespace, so a random model ends
}


# ---- 1. errors ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, message", [
    ({"json": {"type": "foo"}}, r"(?s)structured_outputs.json is invalid: .*foo"),
    ({"json": "{not json"}, r"structured_outputs.json is not valid JSON"),
    ({"regex": "[a-"}, r"(?s)structured_outputs.regex is invalid: .*unclosed character class"),
    ({"grammar": "start: missing_rule\n"}, r"(?s)structured_outputs.grammar is invalid: .*unknown name"),
    ({"choice": []}, r"choice must be a non-empty list"),
    ({"json": SCHEMA, "regex": "a"}, r"exactly one of .*; got json, regex"),
    ({}, r"exactly one of .*; got none"),
    ({"schema": SCHEMA}, r"unknown field\(s\) schema"),
    ({"regex": "a+", "disable_any_whitespace": True}, r"disable_any_whitespace applies to json and json_object only"),
    ({"json_object": True, "disable_any_whitespace": 1}, r"disable_any_whitespace must be true or false"),
])
def test_bad_structured_outputs_are_clear_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(structured_outputs=fields)


def test_structured_outputs_params():
    params = SamplingParams(structured_outputs={"json": SCHEMA})
    assert params.grammar_drafts and isinstance(params.structured_outputs, StructuredOutputs)
    assert not SamplingParams().grammar_drafts
    assert not SamplingParams(structured_outputs={"choice": ["a", "b"]}, grammar_drafts=False).grammar_drafts
    with pytest.raises(ValueError, match="grammar_drafts=True is invalid: must be false without structured_outputs"):
        SamplingParams(grammar_drafts=True)
    # the same schema however written is one key, compiled once
    assert StructuredOutputs(json=SCHEMA).key == StructuredOutputs(json=json.dumps(SCHEMA, indent=2)).key
    assert StructuredOutputs(json_object=True).key == ("json", '{"type": "object"}')
    grammar_text.cache_clear()
    for _ in range(3):
        SamplingParams(structured_outputs={"regex": "ab+"})
    assert grammar_text.cache_info().misses == 1


# ---- a byte-level tokenizer for tiny_llama ------------------------------------------------------------------

class Bytes:
    """Token i is byte i (2 is the end), as llguidance's TokenizerWrapper reads a tokenizer."""
    eos_token_id, bos_token_id, special_token_ids = 2, 1, [1, 2]
    tokens = [b"<s>" if i == 1 else b"</s>" if i == 2 else bytes([i]) for i in range(256)]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def byte_grammars() -> Grammars:
    return Grammars(lambda: llguidance.LLTokenizer(llguidance.TokenizerWrapper(Bytes())))


def byte_engine(folder, spec=None, **kwargs) -> Engine:
    engine = make_engine(folder, spec, **kwargs)
    grammars = byte_grammars()
    engine.grammars = grammars
    if engine.speculator:
        engine.speculator.grammars = grammars
    return engine


def schema_params(max_tokens, grammar_drafts=True, **kwargs):
    return SamplingParams(max_tokens=max_tokens, structured_outputs={"json": SCHEMA}, grammar_drafts=grammar_drafts,
                          **kwargs)


def assert_valid(outputs):
    for out in outputs:
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(bytes(t for t in out.token_ids if t != 2).decode()), SCHEMA)
    assert any(out.finish_reason == "stop" for out in outputs), "no answer ended: the schema was never completed"


def test_disable_any_whitespace_makes_keys_and_separators_forced_tokens():
    """vLLM's disable_any_whitespace: the compact JSON grammar, in which a schema's next key and its separators are
    the only bytes allowed, so the grammar forces them (the grammar drafts); with optional whitespace it forces none."""
    flexible = {k: v for k, v in SCHEMA.items() if k != "x-guidance"}
    compact = StructuredOutputs(json=flexible, disable_any_whitespace=True)
    assert compact.key == StructuredOutputs(json=SCHEMA).key
    assert json.loads(StructuredOutputs(json_object=True, disable_any_whitespace=True).key[1])["x-guidance"] == \
        {"whitespace_flexible": False}
    grammars = byte_grammars()
    forced = {}
    for name, structured in [("compact", compact), ("flexible", StructuredOutputs(json=flexible))]:
        matcher = grammars.matcher(structured)
        assert matcher.consume_token(ord("{"))
        forced[name] = bytes(matcher.compute_ff_tokens())
    assert forced == {"compact": b'"name":"', "flexible": b""}


# ---- 2. greedy equals plain decoding under the grammar ------------------------------------------------------

@pytest.fixture(scope="module")
def heads_root(tmp_path_factory):
    return tmp_path_factory.mktemp("grammar_heads")


PROMPTS = random_prompts([5, 9, 14, 3, 7, 11], seed=21)
_PLAIN: dict = {}


def plain_under_grammar(folder, max_tokens):
    key = (str(folder), max_tokens)
    if key not in _PLAIN:
        engine = byte_engine(folder, max_model_len=256)
        _PLAIN[key] = engine.generate(PROMPTS, schema_params(max_tokens))
        assert_valid(_PLAIN[key])
    return _PLAIN[key]


def drafter_config(kind, folder, heads_root):
    if kind == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    head = random_head_dir("eagle", folder, heads_root)
    spec = {"method": "eagle", "model": head, "num_speculative_tokens": 3, "draft_weights": "float32"}
    return dict(spec, topk=2, num_draft_tokens=6) if kind == "eagle-tree" else spec


SETTINGS = {"c1": dict(max_num_seqs=1), "c4": dict(max_num_seqs=4),
            "c4-preempt": dict(max_num_seqs=4, block_size=4, num_blocks=24, max_model_len=96)}


@pytest.mark.parametrize("grammar_drafts", [True, False], ids=["grammar-drafts", "no-grammar-drafts"])
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("kind", ["ngram", "eagle-chain", "eagle-tree", "random-trees"])
def test_greedy_under_a_grammar_is_plain_decoding(tiny_llama, heads_root, kind, setting, grammar_drafts):
    max_tokens = 60
    plain = plain_under_grammar(tiny_llama, max_tokens)
    if kind == "random-trees":
        engine = byte_engine(tiny_llama, {"method": "ngram", "num_speculative_tokens": 4}, **SETTINGS[setting])
        truth = {tuple(p): out.token_ids for p, out in zip(PROMPTS, plain)}
        engine.speculator.drafter = RandomTreeStub(truth, seed=3)
        engine.speculator.config.num_draft_tokens = 8
    else:
        engine = byte_engine(tiny_llama, drafter_config(kind, tiny_llama, heads_root), **SETTINGS[setting])
    outputs = engine.generate(PROMPTS, schema_params(max_tokens, grammar_drafts))
    for out, expected in zip(outputs, plain):
        assert out.token_ids == expected.token_ids
        assert out.finish_reason == expected.finish_reason
    assert_pool_idle(engine)
    stats = engine.speculator.stats
    assert stats.num_draft_tokens + stats.num_invalid_spec_tokens > 0, "nothing drafted"
    assert (stats.num_grammar_draft_tokens > 0) == grammar_drafts
    assert stats.num_accepted_grammar_draft_tokens <= stats.num_grammar_draft_tokens
    if kind == "random-trees":
        assert stats.num_invalid_spec_tokens > 0 and sum(stats.accepted[1:]) > 0
    if setting == "c4-preempt":
        assert sum(o.metrics["num_preemptions"] for o in outputs) > 0
    assert sum(o.metrics["spec"]["num_invalid_spec_tokens"] for o in outputs) == stats.num_invalid_spec_tokens


# ---- 3. forbidden drafts are never verified ---------------------------------------------------------------

FORBIDDEN = 0x01  # a control byte: JSON holds it nowhere unescaped


class ForbiddenSiblingStub(TruthStub):
    """Plain decoding's next tokens as a chain, and beside its first node a forbidden byte with a child."""

    def tree(self, upcoming, budget):
        self.num_forbidden = getattr(self, "num_forbidden", 0)
        depth = min(budget.depth, budget.num_nodes - 2, len(upcoming))
        if depth < 1:
            return DraftTree()
        self.num_forbidden += 2
        # nodes: the true next token, the forbidden byte, the true tokens after (up_i at node i + 1), a child of the byte
        chain_parents = [0 if i == 1 else i for i in range(1, depth)]
        return DraftTree([upcoming[0], FORBIDDEN, *upcoming[1:depth], ord("a")], [-1, -1, *chain_parents, 1])


def test_forbidden_drafts_are_cut_before_verification_and_counted(tiny_llama):
    max_tokens = 60
    plain = plain_under_grammar(tiny_llama, max_tokens)
    engine = byte_engine(tiny_llama, {"method": "ngram", "num_speculative_tokens": 3}, max_num_seqs=4)
    stub = ForbiddenSiblingStub({tuple(p): out.token_ids for p, out in zip(PROMPTS, plain)})
    engine.speculator.drafter = stub
    engine.speculator.config.num_draft_tokens = 6
    verified = []
    verify = engine.speculator.verify

    def recording_verify(request, logits, best):
        verified.append(request.spec.tree)
        return verify(request, logits, best)

    engine.speculator.verify = recording_verify
    outputs = engine.generate(PROMPTS, schema_params(max_tokens, grammar_drafts=False))
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    assert verified and all(FORBIDDEN not in tree.tokens for tree in verified)
    stats = engine.speculator.stats
    assert stub.num_forbidden > 0 and stats.num_invalid_spec_tokens == stub.num_forbidden
    assert stats.num_draft_tokens == sum(len(tree) for tree in verified)
    assert stats.num_draft_tokens + stats.num_invalid_spec_tokens == sum(
        len(t) for t in verified) + stub.num_forbidden


# ---- 4. the sampled law is the masked target law -------------------------------------------------------------

LETTERS = {0: "a", 1: "b", 3: "c", 4: "d", 5: "e", 6: "f", 7: "g"}  # 2 is the end (v8_target's eos)
REGEX = "[a-g]([ab][c-g]|[cd][a-d])[a-g]*"  # x2 in a-d; after a or b, x3 in c-g; after c or d, x3 in a-d
E2E_PROMPT = [3, 5]
E2E_SAMPLES = 6000


class Letters:
    eos_token_id, bos_token_id, special_token_ids = 2, 1, [2]
    tokens = [LETTERS[i].encode() if i in LETTERS else b"</s>" for i in range(8)]

    def __call__(self, text: bytes) -> list[int]:
        index = {v.encode()[0]: k for k, v in LETTERS.items()}
        return [index[b] for b in text]


def allowed(x2: int | None = None) -> torch.Tensor:
    """The grammar's allowed tokens at x2 (x2=None) or at x3 after x2."""
    if x2 is None:
        letters = "abcd"
    else:
        letters = "cdefg" if LETTERS.get(x2) in ("a", "b") else "abcd"
    return torch.tensor([i in LETTERS and LETTERS[i] in letters for i in range(8)])


def masked_law(folder, params):
    """sum_x1 p(x1) p(x2 | x1) p(x3 | x1, x2) [x2, x3], each p the target's law over the allowed tokens only."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        def probs(contexts, masks):
            logits = hf(torch.tensor(contexts)).logits[:, -1].float()
            return target_probs(torch.where(masks, logits, -torch.inf), params).double()

        letters = torch.tensor([i in LETTERS for i in range(8)])
        p1 = probs([E2E_PROMPT], letters[None])[0]
        p2 = probs([E2E_PROMPT + [x1] for x1 in range(8)], allowed()[None].expand(8, 8))
        p3 = probs([E2E_PROMPT + [x1, x2] for x1 in range(8) for x2 in range(8)],
                   torch.stack([allowed(x2) for _ in range(8) for x2 in range(8)])).view(8, 8, 8)
    return (p1[:, None, None] * p2[:, :, None] * p3).nan_to_num().sum(0), p2, p3


class GrammarTreeStub(Drafter):
    """After x1: a tree of width 2 at depths 1 and 2, with a forbidden node (e, with a child) among the first
    depth's: likely tokens of the masked law, or draws from an imperfect q over all letters (forbidden ones too)."""

    def __init__(self, sampled, p2, p3):
        g = torch.Generator().manual_seed(77)
        self.q1 = torch.softmax(1.5 * torch.randn(8, generator=g), -1)
        self.q2 = torch.softmax(1.5 * torch.randn(8, 8, generator=g), -1)
        self.sampled, self.p2, self.p3, self.generator = sampled, p2, p3, torch.Generator().manual_seed(78)

    def propose(self, ctx, requests, budgets):
        trees = {}
        for r in requests:
            if r.num_output_tokens != 1:
                continue
            e = 5
            if self.sampled:
                a, b = sample(self.q1, self.generator), sample(self.q1, self.generator)
                tokens = [a, b, e, sample(self.q2[a], self.generator), sample(self.q2[a], self.generator),
                          sample(self.q2[b], self.generator), 0]
                q = torch.stack([self.q1, self.q1, self.q1, self.q2[a], self.q2[a], self.q2[b], self.q2[e]])
            else:
                x1 = r.token_ids[-1]
                first, second = self.p2[x1].argsort(descending=True)[:2].tolist()
                tokens = [second, first, e, *self.p3[x1, second].argsort(descending=True)[:2].tolist(),
                          int(self.p3[x1, first].argmax()), 0]
                q = None
            trees[r.request_id] = DraftTree(tokens, (-1, -1, -1, 0, 0, 1, 2), q)
        return trees


@pytest.mark.parametrize("sampled, temperature, top_k", [(False, 1.0, 0), (True, 0.8, 5)],
                         ids=["deterministic-T1", "sampled-T0.8-top5"])
def test_sampled_speculation_under_a_grammar_keeps_the_masked_target_law(v8_target, sampled, temperature, top_k):
    params = [SamplingParams(temperature=temperature, top_k=top_k, seed=i, max_tokens=4,
                             structured_outputs={"regex": REGEX}) for i in range(E2E_SAMPLES)]
    law, p2, p3 = masked_law(v8_target, params[0])
    engine = make_engine(v8_target, {"method": "ngram", "num_speculative_tokens": 2}, block_size=4,
                         num_blocks=1024, max_model_len=64, max_num_seqs=256, max_num_batched_tokens=4096)
    grammars = Grammars(lambda: llguidance.LLTokenizer(llguidance.TokenizerWrapper(Letters())))
    engine.grammars = engine.speculator.grammars = grammars
    engine.speculator.drafter = GrammarTreeStub(sampled, p2.float(), p3.float())
    engine.speculator.config.num_draft_tokens = 8
    outputs = engine.generate([E2E_PROMPT] * E2E_SAMPLES, params)
    assert_pool_idle(engine)
    stats = engine.speculator.stats
    if not sampled:  # every request verifies the tree of width 2 at depths 1 and 2; e and its child are cut
        assert stats.proposed[:2] == [E2E_SAMPLES, E2E_SAMPLES]
        assert stats.num_invalid_spec_tokens == 2 * E2E_SAMPLES
    assert 0 < stats.accepted[0] < stats.reached[0] and 0 < stats.accepted[1] < stats.reached[1]
    assert stats.num_invalid_spec_tokens >= 2 * E2E_SAMPLES
    assert_two_token_law(outputs, law, "the masked target law")


# ---- 5. the server ---------------------------------------------------------------------------------------

def test_server_response_format_json_schema(tmp_path):
    target = targets.build_tiny_model(tmp_path / "tiny_chat", "llama", seed=3,
                                      tokenizer_from=targets.resolve(targets.DEFAULT_TARGET), tie_word_embeddings=True,
                                      max_position_embeddings=1024, initializer_range=0.1)
    engine = Engine(EngineConfig(str(target), max_model_len=512, num_blocks=64, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}))
    messages = [{"role": "user", "content": "Name a pet as JSON."}]
    with running(build_app(engine, "tiny")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        answer = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=200, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}})
        assert answer.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(answer.choices[0].message.content), SCHEMA)
        spec = answer.usage.model_extra["speculative"]
        assert spec["num_grammar_draft_tokens"] > 0 and "num_invalid_spec_tokens" in spec
        with pytest.raises(openai.BadRequestError, match=r"response_format: structured_outputs.json is invalid"):
            client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=8,
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}})
        with pytest.raises(openai.BadRequestError, match=r"regex is invalid"):
            client.completions.create(model="tiny", prompt="hi", max_tokens=8,
                                      extra_body={"structured_outputs": {"regex": "(unclosed"}})
        choice = client.completions.create(model="tiny", prompt="Yes or no?", max_tokens=8, temperature=0,
                                           extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
        assert choice.choices[0].text in ("yes", "no")
        again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=200, temperature=0,
                                               extra_body={"structured_outputs": {"json": SCHEMA}})
        assert again.choices[0].message.content == answer.choices[0].message.content
        flexible = {k: v for k, v in SCHEMA.items() if k != "x-guidance"}
        compact = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=200, temperature=0,
            extra_body={"structured_outputs": {"json": flexible, "disable_any_whitespace": True}})
        assert compact.choices[0].message.content == answer.choices[0].message.content
