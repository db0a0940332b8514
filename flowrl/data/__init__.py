"""What a run reads as data: prompt files and their sets (``prompts``), GenEval's prompt generator (``geneval``), the
source images of editing prompts (``edit_sources``) and the task of each prompt, for per-task scores and
task-balanced batches (``tasks``). Nothing here imports the rest of flowrl."""
