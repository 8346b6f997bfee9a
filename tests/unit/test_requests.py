"""Rollouts as requests (lightning_rlhf.engines.rollout.requests): how a queue that serves requests through an
engine's ``generate`` groups them into calls, cuts each response to its own bound, and shares one prompt among the
samples of a group; the transformers engine's queue against its own ``generate``."""

from __future__ import annotations

from lightning_rlhf.engines.rollout.base import EngineAbilities, RolloutOutput, SamplingParams
from lightning_rlhf.engines.rollout.requests import (
    BatchedRequestQueue,
    Completion,
    Request,
    completion_of,
    shared_prompts,
)
from tests.scripted import tiny_engine


class Recorder:
    """Answers each prompt with ``max_new_tokens`` ids counting up from its last id; records every call."""

    tp_size = 1
    abilities = EngineAbilities()

    def __init__(self, context_length: int | None = None) -> None:
        self.context_length = context_length
        self.calls: list[tuple[list[list[int]], SamplingParams]] = []
        self.requests = BatchedRequestQueue(self)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        self.calls.append((prompts, params))
        out = [[p[-1] + k + 1 for k in range(params.max_new_tokens)] for p in prompts for _ in range(params.n)]
        return RolloutOutput(out, [[-1.0] * len(r) for r in out])


def request(i: int, prompt: list[int], bound: int = 4, **settings) -> Request:
    params = SamplingParams(max_new_tokens=bound, seed=i, **settings)
    return Request(id=str(i), prompt=prompt, params=params, session=i)


def run(engine: Recorder, requests: list[Request]) -> dict[str, Completion]:
    done: dict[str, Completion] = {}
    before = engine.requests.pending()
    engine.requests.add(requests)
    assert engine.requests.pending() == before + len(requests)
    engine.requests.step(lambda c: done.setdefault(c.id, c), True)
    assert engine.requests.pending() == 0
    return done


def test_identical_prompts_share_one_prompt_with_n_samples_only_when_every_prompt_has_as_many() -> None:
    sampled = [request(0, [7, 1]), request(1, [7, 2]), request(2, [7, 1]), request(3, [7, 2])]
    assert [r.id for r in shared_prompts(sampled)[0]] == ["0", "2", "1", "3"] and shared_prompts(sampled)[1] == 2
    assert shared_prompts(sampled[:3])[1] == 1  # 2 copies of one, 1 of the other
    assert shared_prompts(sampled[:2])[1] == 1  # all distinct
    assert shared_prompts([request(0, [7], temperature=0.0), request(1, [7], temperature=0.0)])[1] == 1  # greedy
    assert shared_prompts([request(0, [7], bound=3), request(1, [7], bound=4)])[1] == 1  # other bounds

    engine = Recorder()
    done = run(engine, sampled)
    assert len(engine.calls) == 1
    prompts, params = engine.calls[0]
    assert prompts == [[7, 1], [7, 2]] and params.n == 2
    assert done["3"].ids == [3, 4, 5, 6] and done["0"].ids == [2, 3, 4, 5]


def test_requests_go_in_calls_that_fit_the_context_each_cut_to_its_own_bound() -> None:
    engine = Recorder(context_length=12)
    long = request(0, list(range(1, 9)), bound=3)  # 8 + 3 fits; 8 + 6 would not
    short = [request(1, [1], bound=6), request(2, [2], bound=2)]
    done = run(engine, [long, *short])
    calls = sorted((len(prompts), params.max_new_tokens) for prompts, params in engine.calls)
    assert calls == [(1, 3), (2, 6)]  # the short ones together under the larger bound; the long one alone
    assert done["2"].ids == [3, 4] and done["2"].reason == "length"  # cut to its own bound
    assert len(done["1"].ids) == 6 and len(done["0"].ids) == 3


def test_settings_other_than_the_seed_and_bound_split_calls_and_the_reason_says_why_a_request_ended() -> None:
    engine = Recorder()
    run(engine, [request(0, [5]), request(1, [5], temperature=0.5), request(2, [6])])
    assert sorted(len(prompts) for prompts, _ in engine.calls) == [1, 2]
    stop = SamplingParams(max_new_tokens=4, stop_token_ids=(9,))
    assert completion_of(Request(id="a", prompt=[1], params=stop), [3, 9], None).reason == "stop"  # short
    assert completion_of(Request(id="a", prompt=[1], params=stop), [3, 4, 5, 9], [-1.0] * 4).reason == "stop"
    cut = completion_of(Request(id="a", prompt=[1], params=stop), [3, 4, 5, 6, 7], [-1.0] * 5)
    assert cut.reason == "length" and cut.ids == [3, 4, 5, 6] and cut.logprobs == [-1.0] * 4


def test_an_aborted_request_never_reaches_the_engine() -> None:
    engine = Recorder()
    engine.requests.add([request(0, [5]), request(1, [6])])
    aborted = engine.requests.abort(["1", "unknown"])
    assert [(c.id, c.reason, c.ids) for c in aborted] == [("1", "abort", [])]
    done = run(engine, [])
    assert list(done) == ["0"] and engine.calls[0][0] == [[5]]


def test_the_transformers_queue_continues_a_session_and_samples_what_generate_samples() -> None:
    """A session's second turn runs through the kept keys and values and samples the same ids as a fresh call of the
    same conversation (greedy); a request that ends early is handed on before the step's others end."""
    engine = tiny_engine()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=5)
    first = Request(id="a", prompt=[3, 4, 5], params=greedy, session="s")
    short = Request(id="b", prompt=[6, 7], params=SamplingParams(temperature=0.0, max_new_tokens=2), session="t")
    order: list[str] = []
    done: dict[str, Completion] = {}

    def take(c: Completion) -> None:
        order.append(c.id)
        done[c.id] = c

    engine.requests.add([first, short])
    engine.requests.step(take, True)
    assert order == ["b", "a"] and len(done["b"].ids) == 2  # ended first, handed on first
    follow = first.prompt + done["a"].ids + [9, 10]
    engine.requests.add([Request(id="c", prompt=follow, params=greedy, session="s")])
    engine.requests.step(take, True)
    fresh = engine.generate([follow], greedy).responses[0]
    assert done["c"].ids == fresh
    assert "s" in engine._pasts
    engine.requests.end_sessions(["s", "t"])
    assert not engine._pasts
