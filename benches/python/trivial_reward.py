"""A trivial verl-style reward function: what the pool's own cost is measured with."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str == ground_truth else 0.0
