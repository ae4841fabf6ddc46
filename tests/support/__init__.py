"""The test harness: launchers of real processes, tiny model builders, a realistic update stream.

Not part of the package: tests, benchmarks and the Wordle demo import it from the repository.
"""
