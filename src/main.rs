fn main() {
    std::process::exit(oxrl::cli::main());
}
