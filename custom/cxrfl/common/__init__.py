"""Framework-free pieces every method uses: settings base, run files, model selection, transport."""
