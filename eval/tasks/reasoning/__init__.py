"""Long-generation reasoning (`task=reasoning`): the task (`task`), answer extraction (`answers`)
and the report (`report`)."""
