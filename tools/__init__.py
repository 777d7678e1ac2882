"""Command-line tools and launch helpers at the edge of the repository (the runtime library, grpo/, never imports
them)."""
