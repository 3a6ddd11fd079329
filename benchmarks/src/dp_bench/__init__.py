"""dp-bench: the experiments and benchmark commands of opacus-spectral and peft-lalora (not a library; it lives in
``benchmarks/`` of the repository and is run as ``dp-bench <command>``).

It holds everything that is an experiment rather than something a user imports: datasets and pretrained
weights that install offline (:mod:`dp_bench.data`), the exact frozen-bottom split of a BERT classifier
(:mod:`dp_bench.frozen`), the tasks (:mod:`dp_bench.task`), the one DP training loop and its evaluator
(:mod:`dp_bench.train`), the one experiment runner and report protocol (:mod:`dp_bench.runner`), the one timed-steps
helper (:mod:`dp_bench.timing`) and the commands (:mod:`dp_bench.commands`). Laid out like a Flower app: ``task``
(data + model), the client side (the training loop, or ``peft_lalora.federated``'s ``DPClient``/``ClientApp``) and
the server side (``peft_lalora``'s runners, fed a task from here).
"""

__version__ = "0.1.0"
