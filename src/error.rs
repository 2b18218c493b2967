//! The words for how a caller reacts to an error (retry, fix the configuration, or take the
//! refusal as the answer) and how an error is shown with its causes. Which reaction an error
//! calls for is decided in `reaction.rs`, above the layers whose errors it reads, so that the
//! store and the broker can name their reaction without importing what reads it.

use std::fmt;

/// What a caller does about an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Reaction {
    /// A server is down or unreachable, or a connection broke: try again later.
    Retry,
    /// The configuration is wrong (a URL, a password, a missing database, vhost or schema): no
    /// retry helps until a person fixes it.
    Fix,
    /// The request was refused (a conflict, a stale fence, a decision that does not fit the run,
    /// bad input): the refusal is the answer.
    Refused,
}

/// A boxed cause, kept as the `source` of the error that wraps it.
pub type Cause = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Shows an error with its chain of causes on one line (`what: cause: cause`), for logs and
/// terminals: every error here keeps its cause as its `source` instead of printing it. A
/// driver's error (Postgres, RabbitMQ, I/O) ends the chain with the server's own words, without
/// the driver's repetitions and source positions.
pub struct Report<'a>(pub &'a (dyn std::error::Error + 'static));

impl fmt::Display for Report<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut next = Some(self.0);
        let mut first = true;
        while let Some(e) = next {
            if !first {
                f.write_str(": ")?;
            }
            first = false;
            if let Some(words) = driver_words(e) {
                return f.write_str(&words);
            }
            write!(f, "{e}")?;
            next = e.source();
        }
        Ok(())
    }
}

/// What a driver's error says, in the server's words, if `e` is one.
fn driver_words(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    if let Some(e) = e.downcast_ref::<sqlx::Error>() {
        return Some(match e {
            sqlx::Error::Database(db) => db.message().to_owned(),
            sqlx::Error::Io(io) => io.to_string(),
            sqlx::Error::PoolTimedOut => {
                "no connection within the pool's timeout (the server is down, unreachable or out of connections)".into()
            }
            other => other.to_string(),
        });
    }
    if let Some(e) = e.downcast_ref::<lapin::Error>() {
        return Some(match e.kind() {
            lapin::ErrorKind::ProtocolError(amqp) => amqp.get_message().to_string(),
            lapin::ErrorKind::IOError(io) => io.to_string(),
            _ => e.to_string(),
        });
    }
    e.downcast_ref::<std::io::Error>().map(ToString::to_string)
}
