"""Vision models and data: ResNeSt, split attention, image folders, RecordIO, transforms."""
