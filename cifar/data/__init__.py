"""The data stage: download, verify, extract, validate, convert to TFRecords, statistics."""
