//! `dmkit thin dump|restore|check`.

/// Entry point for `dmkit thin ...`; returns the process exit status.
pub fn main(args: &[String]) -> i32 {
    eprintln!("dmkit thin {}: not implemented yet", args.join(" "));
    2
}
