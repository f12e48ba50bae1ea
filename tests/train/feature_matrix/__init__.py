"""The feature matrix (issue "GPU readiness", item 2): every combination of the main job's
features the config accepts, parsed the way the main job parses it and, where accepted, run.

* **Generator** (:func:`axes`, :func:`combinations`): the axes come from the code -- the
  attention backends (``core_attention.BACKENDS`` + ``auto``), the dtypes
  (``train.config.DTYPES``), the CPU-sized models (``configs/model/tiny_*.yaml``), the MoE
  expert backends (``moe.config.EXPERT_BACKENDS``), the FP8 recipes (``FP8Config``), the
  boolean feature switches and the parallel sizes (every ``*parallel_size`` field of
  ``ParallelConfig``) -- so a new option joins the matrix by itself. Axes that do not apply
  (the expert backend of a dense model, the FP8 settings with FP8 off) collapse to ``-``.
* **Two worlds** (the ``transformer_engine`` axis): this machine without Transformer Engine,
  and a GPU user's with it -- the fake TE 2.10 (``tests/support/fake_te``), importable only in
  child processes. The TE world adds the ``linear`` (``fastpath.linear_impl``) and ``te_rng``
  (``cuda_graphs.use_te_rng_tracker``) axes; a child process classifies it
  (``python -m tests.workers.feature_matrix_te_classify_worker --classify-te``) and its verdicts are committed
  (``feature_matrix_te.json``, checked current by :func:`test_te_world_verdicts_are_current`).
* **Classifier** (:func:`classify`): each combination is parsed by ``parse_job_config`` on
  ``training.device=cuda`` under the GPU stand-ins (``tests/support/graph_safe_standins.py``:
  CUDA-as-CPU mode, fake CUDA graph, flash-attn / TE attention stand-ins). A refusal must be
  the first of ``rules.refusals(facts)`` for the facts the job handed the rules, or -- when the
  rules have nothing against the facts -- a missing-package message or one naming the setting.
* **Runner** (tests/support/matrix_runs.py ``straight_vs_resumed``): an accepted combination
  trains 4 steps straight with checkpoints on, saving at step 3 (``checkpoint.interval=3``;
  the async save is written while step 4 trains) and at the end; then the step-3 checkpoint,
  copied alone into a fresh directory, is resumed and step 4 trained. The losses and learning
  rates of all 4 steps and the final parameters (every rank's) must be bit-identical between
  the two runs (as tests/checkpoint/test_resume_main_job.py asserts on the CPU path), and the
  straight run must have built what the combination asks (graph runners, expert class). With
  graphs on, Megatron 0.16.1 captures every layer at the end of step 1 and replays it in steps
  2-4; the resumed run captures again at the end of its first step (step 4), so its step 4
  runs eagerly against the straight run's replay. The sync sentinel counts the resumed run's
  step only (``training.sync_check=off`` in the straight run): every combination trains one
  step inside its modes, equal to the straight run's step without them, and showing exactly
  the host reads expected (``matrix_runs.expected_syncs``). Each run builds the job from
  ``config_tree(combo)`` (equal to Hydra's composition:
  :func:`test_config_tree_is_hydras_composition`), not from Hydra. (The straight run saving at step 3 checks the
  resume with 5 steps, where a separate stopped run would take 8.)
* **Runs** (integration tier): of each group of accepted combinations -- per world, the
  world-1 ones (status ``RUN``) and each layout's world-2 ones (``WORLD2``, one parallel size
  2) -- the jobs of a pairwise cover (:func:`ci_cover`: every pair of axis values that occurs
  together in an accepted combination of the group occurs together in one that runs), in worker
  processes that train their combinations one after the other (tests/workers/matrix_worker.py)
  -- the world-1 ones dealt round-robin to ``W1_SHARDS`` tests, each running
  its half-shards in 2 processes at once (:func:`test_world_of_one_runs`); the world-2 ones
  of every layout, layout after layout, in ``W2_PARTS`` ``torchrun`` launches of 2 processes
  per world (:func:`test_world_of_two_runs`). A job runs once: combinations whose parsed jobs
  are equal (:func:`job_key`; ``auto`` and the backend it resolves to) share one run
  (:func:`distinct_jobs`). The **full
  tier** (:func:`test_full_tier`, by hand: ``FASTPATH_FULL_MATRIX=<dir>``) trains the
  jobs of every accepted combination the CI runs leave out; its last run is recorded in
  ``feature_matrix_full_run.json`` (:func:`record_full_run`). A test
  lists every combination it ran and fails listing every one that failed. The flex backend,
  which has no backward on a CPU, trains on the test-only FlexAttention stand-in
  (``tests/support/flex_standin.py``: torch's real flex forward, a dense backward, the CUDA
  kernel's contracts, e.g. heads at least 16 wide). A
  combination a known bug breaks (:data:`KNOWN_BUGS`) is checked to fail exactly so.
  docs/feature-matrix.md lists every run combination with the test that runs it, and the
  measured wall times.

The package: ``matrix.py`` (generator, classifier, runner), ``doc.py`` (docs/feature-matrix.md,
generated: ``render``, kept equal by ``test_listing_is_up_to_date``), tests/workers/feature_matrix_te_classify_worker.py (the TE
world's classifier); the tests are tests/train/test_feature_matrix.py.
"""
