fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("thin") {
        std::process::exit(dmkit::thin::cli::main(&args[1..]));
    }
    eprintln!("usage: dmkit <serve|create|...|thin>");
    std::process::exit(2);
}
