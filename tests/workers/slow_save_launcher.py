"""Test-only launcher: ``python slow_save_launcher.py <hydra overrides>`` runs the main job with
Megatron's ``dist_checkpointing.save`` wrapped so that, once the tensor files of the checkpoint
of step $FASTPATH_TEST_HANG_AT_STEP are written (and before it is published), it touches
$FASTPATH_TEST_MARKER and sleeps -- so a test can SIGKILL the job in the middle of a save."""

import os
import sys
import time


def main() -> None:
    from megatron.core import dist_checkpointing

    hang = f"step_{int(os.environ['FASTPATH_TEST_HANG_AT_STEP']):08d}"
    marker = os.environ["FASTPATH_TEST_MARKER"]
    real_save = dist_checkpointing.save

    def save(sharded, checkpoint_dir, *args, **kwargs):
        result = real_save(sharded, checkpoint_dir, *args, **kwargs)
        if hang in str(checkpoint_dir):
            open(marker, "w").close()
            time.sleep(600)
        return result

    dist_checkpointing.save = save
    from megatron_fastpath.train import main as train_main

    sys.argv = ["megatron_fastpath.train", *sys.argv[1:]]
    train_main()


if __name__ == "__main__":
    main()
