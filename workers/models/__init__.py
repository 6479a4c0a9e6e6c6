"""Where models come from: known names, GGUF conversion, the packaged demo family, chat rendering."""
