"""The hooks' feature matrix (the hooks' half of the feature matrices): every combination of what the NeMo 2 /
Megatron-Bridge hooks read -- the user's :class:`HookRequest` and the :class:`ModelFacts` of
the framework config -- through their shared decision layer ``integrations/core.py``.

* **Generator** (:func:`axes`, :func:`combinations`): the axes come from the code -- the
  attention backends (``core_attention.BACKENDS`` + ``auto``), the FP8 formats
  (``core.FP8_FORMATS``), the LoRA targets (``lora.config.LORA_TARGETS``), the expert backends
  (``moe.config.EXPERT_BACKENDS``), the dtypes (``train.config.DTYPES``), the parallel sizes
  (every ``*parallel*`` / ``*pipeline*`` size field of ``ModelFacts`` plus the model config's
  ``tensor_model_parallel_size``), the ``HookRequest`` switches and the ``ModelFacts`` the
  shared rules read -- so a new option joins the matrix by itself. Axes that do not apply
  collapse to ``-`` (the config's own graphs / FP8 when the request overrides them, the MoE
  axes of a dense model, the attention backend without the packed cache, ...). Reduction: a
  value refused on its own whatever the rest (``Axis.alone``: an unsupported PEFT, CP or a
  virtual pipeline with the cache, FP8 attention on packed sequences, ...) is crossed with the
  first value of every later axis only; the claim is checked by swapping the value into the
  accepted combinations (:func:`test_lone_refusals_refuse_every_accepted_combination`).
  ``HookRequest`` fields that are not axes are listed with why (:data:`NOT_CROSSED`, checked),
  and hook-only messages of settings the product does not vary are reached one setting away
  from a runnable combination (:data:`ONE_AWAY`).
* **Classifier** (:func:`classify`): each combination goes through ``core.refusals`` (and
  ``core.decide``). Its reasons must be the rules' reasons for ``core.run_facts`` (spelled with
  the hook's ``rules.NAMES``), in order, after hook-only reasons that each match one of the
  messages ``core.py`` writes (read from its source, :func:`hook_messages`). An accepted
  combination gets ``core.plan``; its settings must make a ``FastpathSettings``, and the layer
  spec's build-time check (``resolve_backend`` on the training GPU with the model dtype) runs
  on it: what it refuses is listed as accepted by the hook but refused at build.
* **Runner** (:func:`run_combination`, integration tier): the accepted world-1 combinations a
  CPU can run, once per distinct build (:func:`build_inputs`: the axes that change the built
  model, :data:`BUILT`, the hook's plan and the model config -- all the runner reads) -- in
  the CI the builds of a pairwise cover of each launch's combinations (:func:`ci_runs`), in
  the by-hand full tier (``FASTPATH_FULL_MATRIX``) every one --, builds
  the model the hooked config builds (``FastpathLayerSpec`` of the plan's settings, the plan's
  position embedding) inside the GPU stand-ins and runs one
  forward + backward through ``packed_seq.runtime.forward``: finite loss and gradients, the
  attention backend and experts the classifier predicted, and -- in fp32 with the packed cache
  and dropless (or no) experts -- per-token losses equal to the same weights with Megatron's
  attention and RoPE, one sequence at a time (capacity dispatch couples the sequences; bf16
  has no tolerance that would make a per-sequence comparison meaningful). Layouts of 2
  processes run in torchrun children (:func:`test_hook_feature_matrix_child_runs`); the
  pipeline layout through Megatron's own schedule, as the framework drives the hooked model
  (:func:`run_pipelined`).

The package: ``matrix.py`` (generator, classifier, runner), ``doc.py`` (docs/hook-feature-matrix.md,
generated: ``render``, kept equal by ``test_listing_is_up_to_date``), tests/workers/hook_matrix_worker.py (the child
runs); the tests are tests/integrations/test_hook_feature_matrix.py.
"""
