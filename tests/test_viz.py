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


def test_every_plot_helper_returns_its_figure():
    """A helper that draws a figure and returns None makes the book glue "None" under a numbered caption
    (chapter 7's four figures once did); the browser test catches it on the page, this catches it here."""
    import ast
    import inspect

    from specnb import plots

    tree = ast.parse(inspect.getsource(plots))
    silent = [f.name for f in tree.body if isinstance(f, ast.FunctionDef) and "subplots" in ast.unparse(f)
              and not any(isinstance(n, ast.Return) and n.value is not None for n in ast.walk(f))]
    assert not silent, f"plot helpers that do not return their figure: {silent}"
