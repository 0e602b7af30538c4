//! Chat templates: the model's own Jinja template, rendered as transformers'
//! `apply_chat_template(messages, tools=..., add_generation_prompt=True, **kwargs)` renders it
//! (trimmed and left-stripped blocks, loop controls, `raise_exception`, `strftime_now`, `tojson`
//! as Python's `json.dumps` writes, Python's string and dict methods, `tools` (none without
//! them), `documents` as none, the special tokens by name, extra keyword arguments such as
//! `enable_thinking`).

use minijinja::value::Kwargs;
use minijinja::{Environment, Error, ErrorKind, Value};
use std::collections::BTreeMap;

/// A compiled chat template and the special-token strings it is rendered with.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// `bos_token`, `eos_token`, `unk_token`, `pad_token` as the tokenizer config gives them.
    specials: BTreeMap<String, String>,
    /// The template's text.
    source: String,
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
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source.clone()).map_err(|e| format!("the chat template does not compile: {e}"))?;
        Ok(ChatTemplate { env, specials, source })
    }

    /// The template's text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The special tokens it is rendered with.
    pub fn specials(&self) -> &BTreeMap<String, String> {
        &self.specials
    }

    /// Renders `messages` (a JSON list of `{role, content}` with string content) with
    /// `add_generation_prompt = true`. A template's `raise_exception` comes back as the error.
    #[cfg(test)]
    pub fn render(&self, messages: &serde_json::Value) -> Result<String, String> {
        self.render_with(messages, true)
    }

    /// Renders `messages` with `add_generation_prompt` as given (training renders whole
    /// conversations without it, and each prefix before an assistant turn with it).
    pub fn render_with(&self, messages: &serde_json::Value, add_generation_prompt: bool) -> Result<String, String> {
        self.render_full(messages, add_generation_prompt, None, &serde_json::Map::new())
    }

    /// Renders `messages` with `tools` (the request's list as given, `None`: none) and the
    /// request's `chat_template_kwargs` (`kwargs`, which cannot replace `messages`, `tools` or
    /// `add_generation_prompt`).
    pub fn render_full(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, String> {
        let tmpl = self.env.get_template(NAME).map_err(|e| e.to_string())?;
        let mut ctx: BTreeMap<String, Value> =
            self.specials.iter().map(|(k, v)| (k.clone(), Value::from(v.clone()))).collect();
        ctx.insert("documents".into(), Value::from(()));
        for (k, v) in kwargs {
            ctx.insert(k.clone(), Value::from_serialize(v));
        }
        ctx.insert("messages".into(), Value::from_serialize(messages));
        ctx.insert("add_generation_prompt".into(), Value::from(add_generation_prompt));
        ctx.insert("tools".into(), tools.map_or(Value::from(()), Value::from_serialize));
        tmpl.render(ctx).map_err(|e| match e.kind() {
            ErrorKind::InvalidOperation => e.detail().unwrap_or("the chat template refused the messages").to_string(),
            _ => format!("the chat template failed: {e}"),
        })
    }
}

/// `x | tojson(indent=None)` as transformers defines it: Python's `json.dumps(x,
/// ensure_ascii=False)`, items separated by `", "` and keys by `": "` (by `","` and newlines with
/// an `indent`), keys in their given order, nothing HTML-escaped.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let _ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value).map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    Ok(Value::from_safe_string(python_json(&json, indent)))
}

/// `json.dumps(v, ensure_ascii=False, indent=indent)` as Python writes it.
pub fn python_json(v: &serde_json::Value, indent: Option<usize>) -> String {
    use serde::Serialize;
    let mut out = Vec::new();
    let r = match indent {
        Some(n) => {
            let pad = vec![b' '; n];
            v.serialize(&mut serde_json::Serializer::with_formatter(
                &mut out,
                serde_json::ser::PrettyFormatter::with_indent(&pad),
            ))
        }
        None => v.serialize(&mut serde_json::Serializer::with_formatter(&mut out, PythonFormatter)),
    };
    debug_assert!(r.is_ok());
    String::from_utf8(out).unwrap_or_default()
}

/// serde_json's compact output with Python's `", "` and `": "` separators.
struct PythonFormatter;

impl serde_json::ser::Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
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
    fn tojson_writes_as_python_json_dumps() {
        let t = ChatTemplate::new("{{ x | tojson }}|{{ x | tojson(indent=2) }}".into(), BTreeMap::new()).unwrap();
        let x = json!({"b": [1, 2.5, "<é>"], "a": {"q\"": null, "e": []}});
        let got = t.render_full(&json!([]), false, None, json!({"x": x}).as_object().unwrap()).unwrap();
        // What Python prints for json.dumps(x, ensure_ascii=False) and with indent=2.
        assert_eq!(
            got,
            "{\"b\": [1, 2.5, \"<é>\"], \"a\": {\"q\\\"\": null, \"e\": []}}|{\n  \"b\": [\n    1,\n    2.5,\n    \"<é>\"\n  ],\n  \"a\": {\n    \"q\\\"\": null,\n    \"e\": []\n  }\n}"
        );
    }

    #[test]
    fn tools_and_kwargs_reach_the_template() {
        let src = "{% for t in tools %}{{ t.function.name }};{% endfor %}{{ enable_thinking }}|{{ messages | length }}";
        let t = ChatTemplate::new(src.into(), BTreeMap::new()).unwrap();
        let tools =
            json!([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g"}}]);
        let kw = json!({"enable_thinking": false, "messages": "ignored"});
        let got =
            t.render_full(&json!([{"role": "user", "content": "x"}]), true, Some(&tools), kw.as_object().unwrap());
        assert_eq!(got.unwrap(), "f;g;False|1");
        let none = ChatTemplate::new("{% if tools %}T{% else %}N{% endif %}".into(), BTreeMap::new()).unwrap();
        assert_eq!(none.render(&json!([])).unwrap(), "N");
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
