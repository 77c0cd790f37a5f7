"""The trainer, run from a checkout: `python trainer.py --model=KEY ...` (installed: `gpipe-trainer`).

The program is `gpipe_tf.trainer_main`; `python trainer.py --help` lists its flags.
"""

from gpipe_tf.trainer_main import run

if __name__ == "__main__":
    run()
