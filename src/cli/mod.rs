//! The `oxrl` command line.
