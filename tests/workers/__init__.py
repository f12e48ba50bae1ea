"""The suite's child-process workers: every script a test starts as a child process (under
``torchrun``, ``python -m tests.workers.<name>`` or by path) lives here, named after what it runs."""
