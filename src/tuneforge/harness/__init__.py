"""lm-evaluation-harness in-process: `tuneforge eval MODEL --harness TASKS` and `--harness-after-train TASKS`.

options.py: what one harness run is (HarnessSettings: the flags and the train config key); tasks.py: the harness's
tasks by name and built; local_data.py: a task's data from local files, its own config otherwise unchanged;
evaluate.py: the model as the harness's HFLM, the run (`run_harness`, any harness model too) and its files;
command.py: `tuneforge eval --harness`; after_train.py: the run after training. Importing this package imports
neither torch nor lm_eval.
"""
