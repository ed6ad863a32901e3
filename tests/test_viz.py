"""The step visualizer reconstructs each round faithfully."""
from specnb.decode import greedy, speculative_greedy
from specnb.drafts import ModelDraft
from specnb.viz import RecordingDraft, rounds_html, trace_rounds


class IdTokenizer:
    def decode(self, ids):
        return " ".join(f"<{i}>" for i in ids)


def test_trace_matches_the_run(target, noisy_draft_model, prompts):
    recorder = RecordingDraft(ModelDraft(noisy_draft_model))
    result = speculative_greedy(target, recorder, prompts[3], 4, 24)
    views = trace_rounds(result, recorder)
    assert len(views) == len(result.rounds)
    rebuilt = [t for v in views for t in v.accepted + [v.target_token]]
    assert rebuilt == result.tokens == greedy(target, prompts[3], 24).tokens
    for v in views:
        if v.rejected is not None:
            assert v.kind == "correction" and v.rejected != v.target_token
        if v.kind == "bonus":
            assert v.rejected is None and len(v.accepted) == v.drafted
    assert any(v.rejected is not None for v in views)  # the draft is imperfect: rejections are shown
    page = rounds_html(views, IdTokenizer())
    assert page.count('title="rejected"') == sum(v.rejected is not None for v in views) + 1  # + legend
    assert f"{len(views)} rounds" in page
    # prefill included on both sides: plain greedy's forwards are its tokens, the speculative run's its
    # rounds plus the prefill
    plain = greedy(target, prompts[3], 24)
    assert plain.target_forwards == len(plain.tokens)
    assert result.target_forwards == len(result.rounds) + 1
    saved = plain.target_forwards - result.target_forwards
    assert f"{result.target_forwards} target forwards with the prefill" in page
    assert f"so {saved} were saved" in page


def test_every_plot_helper_returns_its_figure():
    """A helper that draws a figure and returns None makes the book glue "None" under a numbered caption
    (chapter 7's four figures once did); the browser test catches it on the page, this catches it here."""
    import ast
    import inspect

    from specnb import plots

    tree = ast.parse(inspect.getsource(plots))

    def figure_name(f):
        """The name bound to the figure by ``fig, ... = plt.subplots(...)`` (or ``fig = plt.figure()``)."""
        for node in ast.walk(f):
            if isinstance(node, ast.Assign) and "subplots" in ast.unparse(node.value):
                target = node.targets[0]
                return (target.elts[0] if isinstance(target, ast.Tuple) else target).id
        return None

    bad = []
    for f in tree.body:
        if not (isinstance(f, ast.FunctionDef) and "subplots" in ast.unparse(f)):
            continue
        name = figure_name(f)
        returns = [n for n in ast.walk(f) if isinstance(n, ast.Return)]
        last = f.body[-1]
        if (name is None or any(r.value is None for r in returns) or not isinstance(last, ast.Return)
                or not (isinstance(last.value, ast.Name) and last.value.id == name)):
            bad.append(f.name)
    assert not bad, f"plot helpers that do not end by returning the figure they drew: {bad}"


def test_recording_draft_in_sampling_mode_changes_nothing(target, noisy_draft_model, prompts):
    """RecordingDraft delegates propose_sampled: the same seed gives the same tokens with and without it,
    and every round's proposal is recorded."""
    from specnb.decode import speculative_sample
    from specnb.drafts import ModelDraft
    from specnb.sampling import SamplingParams
    from specnb.viz import RecordingDraft

    params = SamplingParams(temperature=0.8)
    bare = speculative_sample(target, ModelDraft(noisy_draft_model), prompts[2], 3, 16, params, seed=5)
    rec = RecordingDraft(ModelDraft(noisy_draft_model))
    wrapped = speculative_sample(target, rec, prompts[2], 3, 16, params, seed=5)
    assert wrapped.tokens == bare.tokens
    assert len(rec.proposals) == len(wrapped.rounds)
    assert all(len(p) >= r.drafted for p, r in zip(rec.proposals, wrapped.rounds))
    assert sum(map(len, rec.proposals)) > 0
