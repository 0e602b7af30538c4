//! Chat templates: the model's own Jinja template, rendered as transformers'
//! `apply_chat_template(messages, add_generation_prompt=True)` renders it (trimmed and
//! left-stripped blocks, loop controls, `raise_exception`, `strftime_now`, `tojson`, Python's
//! string and dict methods, `tools` and `documents` passed as none, the special tokens by name).

use minijinja::{Environment, Error, ErrorKind, Value};
use std::collections::BTreeMap;

/// A compiled chat template and the special-token strings it is rendered with.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// `bos_token`, `eos_token`, `unk_token`, `pad_token` as the tokenizer config gives them.
    specials: BTreeMap<String, String>,
}

/// The template's name inside its environment.
const NAME: &str = "chat";

impl ChatTemplate {
    /// Compiles `source`; `specials` are passed to every render by name.
    pub fn new(source: String, specials: BTreeMap<String, String>) -> Result<ChatTemplate, String> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(NAME, source).map_err(|e| format!("the chat template does not compile: {e}"))?;
        Ok(ChatTemplate { env, specials })
    }

    /// Renders `messages` (a JSON list of `{role, content}` with string content) with
    /// `add_generation_prompt = true`. A template's `raise_exception` comes back as the error.
    pub fn render(&self, messages: &serde_json::Value) -> Result<String, String> {
        self.render_with(messages, true)
    }

    /// Renders `messages` with `add_generation_prompt` as given (training renders whole
    /// conversations without it, and each prefix before an assistant turn with it).
    pub fn render_with(&self, messages: &serde_json::Value, add_generation_prompt: bool) -> Result<String, String> {
        let tmpl = self.env.get_template(NAME).map_err(|e| e.to_string())?;
        let mut ctx: BTreeMap<String, Value> =
            self.specials.iter().map(|(k, v)| (k.clone(), Value::from(v.clone()))).collect();
        ctx.insert("messages".into(), Value::from_serialize(messages));
        ctx.insert("add_generation_prompt".into(), Value::from(add_generation_prompt));
        ctx.insert("tools".into(), Value::from(()));
        ctx.insert("documents".into(), Value::from(()));
        tmpl.render(ctx).map_err(|e| match e.kind() {
            ErrorKind::InvalidOperation => e.detail().unwrap_or("the chat template refused the messages").to_string(),
            _ => format!("the chat template failed: {e}"),
        })
    }
}

/// `raise_exception(msg)`: the template refuses the conversation.
fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// `strftime_now(format)`: the current UTC time in `format` (`%Y %m %d %e %b %B %a %A %H %M %S
/// %y %j %%`, and `%-d` / `%-m` without padding).
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    strftime(&format, secs)
}

/// Formats `secs` since the Unix epoch (UTC) as `strftime_now` does.
pub fn strftime(format: &str, secs: u64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Thursday", "Friday", "Saturday", "Sunday", "Monday", "Tuesday", "Wednesday"];
    let days = secs / 86_400;
    let (y, m, d) = civil_from_days(days);
    let tod = secs % 86_400;
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(m - 1) as usize] + d + u64::from(leap && m > 2);
    let month = MONTHS[(m - 1) as usize];
    let weekday = DAYS[(days % 7) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut spec = chars.next();
        let unpadded = spec == Some('-');
        if unpadded {
            spec = chars.next();
        }
        let num = |v: u64, w: usize| if unpadded { v.to_string() } else { format!("{v:0w$}") };
        match spec {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&num(y % 100, 2)),
            Some('m') => out.push_str(&num(m, 2)),
            Some('d') => out.push_str(&num(d, 2)),
            Some('e') => out.push_str(&format!("{d:>2}")),
            Some('j') => out.push_str(&num(yday, 3)),
            Some('b') => out.push_str(&month[..3]),
            Some('B') => out.push_str(month),
            Some('a') => out.push_str(&weekday[..3]),
            Some('A') => out.push_str(weekday),
            Some('H') => out.push_str(&num(tod / 3600, 2)),
            Some('M') => out.push_str(&num(tod / 60 % 60, 2)),
            Some('S') => out.push_str(&num(tod % 60, 2)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// (year, month 1..=12, day 1..=31) of `days` since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + u64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Llama 3's template text (its structure: a default system message, headers, `| trim`,
    /// loop controls and `raise_exception`).
    const LLAMA3: &str = r#"{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "Today is " + strftime_now("%d %b %Y") + "." %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.role == 'tool' %}{% continue %}{% endif %}
    {%- if message.role not in ['user', 'assistant'] %}
        {{- raise_exception("Conversation roles must be user or assistant, got " + message.role) }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"#;

    /// Qwen2's template structure (no bos, `<|im_start|>`, Python string methods, `tools`).
    const QWEN2: &str = r#"{%- if tools %}{{ raise_exception('no tools') }}{%- endif %}
{%- for message in messages %}
    {%- if loop.first and message.role != 'system' %}
        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\n' + message.content.strip() + '<|im_end|>' + '\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"#;

    fn specials() -> BTreeMap<String, String> {
        BTreeMap::from([("bos_token".into(), "<|begin_of_text|>".into()), ("eos_token".into(), "<|eot_id|>".into())])
    }

    #[test]
    fn llama3_renders_as_transformers() {
        let t = ChatTemplate::new(LLAMA3.into(), specials()).unwrap();
        let got = t
            .render(&json!([{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi"}]))
            .unwrap();
        assert_eq!(
            got,
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>\
             <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\n"
        );
    }

    #[test]
    fn llama3_default_system_uses_strftime_now_and_refusals_come_back() {
        let t = ChatTemplate::new(LLAMA3.into(), specials()).unwrap();
        let got = t.render(&json!([{"role": "user", "content": "Hi"}])).unwrap();
        assert!(got.contains("Today is ") && got.contains(&strftime_now("%Y".into())), "{got}");
        let err = t.render(&json!([{"role": "narrator", "content": "x"}])).unwrap_err();
        assert_eq!(err, "Conversation roles must be user or assistant, got narrator");
    }

    #[test]
    fn qwen2_renders_with_python_methods() {
        let t = ChatTemplate::new(QWEN2.into(), BTreeMap::new()).unwrap();
        let got = t.render(&json!([{"role": "user", "content": " Hi "}])).unwrap();
        assert_eq!(
            got,
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\n"
        );
    }

    #[test]
    fn a_broken_template_is_an_error() {
        assert!(ChatTemplate::new("{% for %}".into(), BTreeMap::new()).is_err());
    }

    #[test]
    fn strftime_matches_known_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday, day 60 of a leap year.
        let t = 1_709_211_909;
        assert_eq!(strftime("%d %b %Y", t), "29 Feb 2024");
        assert_eq!(strftime("%A %B %-d %H:%M:%S %j %y %%", t), "Thursday February 29 13:05:09 060 24 %");
        assert_eq!(strftime("%Y-%m-%d", 0), "1970-01-01");
    }
}
